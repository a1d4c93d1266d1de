"""Layer mapping: which target layers receive translated KV, and which source layer feeds each of them.

Layers are matched by relative depth (the top layer of one model to the top layer of the other). *Replay*
injects a window of target layers — by default top-aligned and about 30% of the shallower model's depth, as in
the paper; start and width are configurable so the early-vs-late injection sweep can be run. *Direct*
injection (``inject-all``) translates every target layer, since the target never runs over the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from mot_cag.names import COVERAGES, Coverage, choose

#: Share of the shallower model's depth injected by default in replay mode (the paper's window).
DEFAULT_WINDOW_RATIO = 0.3


def source_layer_for(target_layer: int, source_layers: int, target_layers: int) -> int:
    """The source layer at the same relative depth as ``target_layer`` (top maps to top)."""
    s = round((target_layer + 1) * source_layers / target_layers) - 1
    return min(source_layers - 1, max(0, s))


def default_window(source_layers: int, target_layers: int, ratio: float = DEFAULT_WINDOW_RATIO) -> tuple[int, int]:
    """Top-aligned replay window ``(start, width)`` in target layers."""
    width = max(1, round(ratio * min(source_layers, target_layers)))
    width = min(width, target_layers)
    return target_layers - width, width


@dataclass(frozen=True)
class LayerMap:
    """Target layers that receive translated KV and, position by position, the source layers that feed them.

    Attributes:
        target_layers: Ascending target layer indices (all layers for inject-all).
        source_layers: Same length; ``source_layers[i]`` feeds ``target_layers[i]``.
        window_start: First target layer of the replay window.
        window_width: Number of target layers in the replay window.
    """

    target_layers: tuple[int, ...]
    source_layers: tuple[int, ...]
    window_start: int
    window_width: int

    @property
    def size(self) -> int:
        """Number of translated target layers."""
        return len(self.target_layers)

    def window_positions(self) -> list[int]:
        """Indices into :attr:`target_layers` of the replay window's layers."""
        window = range(self.window_start, self.window_start + self.window_width)
        return [i for i, t in enumerate(self.target_layers) if t in window]

    @classmethod
    def build(
        cls,
        source_layers: int,
        target_layers: int,
        coverage: Coverage = "inject-all",
        window_start: int | None = None,
        window_width: int | None = None,
    ) -> LayerMap:
        """Build the map for a pair of depths.

        Args:
            source_layers: Source model depth.
            target_layers: Target model depth.
            coverage: ``inject-all`` translates every target layer; ``replay`` only the window.
            window_start: First target layer of the window (default: top-aligned).
            window_width: Window width in layers (default: 30% of the shallower depth, at least 1).

        Raises:
            ValueError: If the window does not fit in the target.
        """
        coverage = choose("coverage", coverage, COVERAGES, ValueError)
        d_start, d_width = default_window(source_layers, target_layers)
        width = d_width if window_width is None else window_width
        start = (target_layers - width) if window_start is None else window_start
        if width < 1 or start < 0 or start + width > target_layers:
            raise ValueError(
                f"Injection window start={start} width={width} does not fit a {target_layers}-layer target; "
                f"use 0 <= start and start + width <= {target_layers}."
            )
        targets = tuple(range(target_layers)) if coverage == "inject-all" else tuple(range(start, start + width))
        sources = tuple(source_layer_for(t, source_layers, target_layers) for t in targets)
        return cls(targets, sources, start, width)

    def to_dict(self) -> dict:
        """JSON form saved with the translator."""
        return {"target_layers": list(self.target_layers), "source_layers": list(self.source_layers),
                "window_start": self.window_start, "window_width": self.window_width}

    @classmethod
    def from_dict(cls, d: dict) -> LayerMap:
        """Inverse of :meth:`to_dict`."""
        return cls(tuple(d["target_layers"]), tuple(d["source_layers"]), int(d["window_start"]),
                   int(d["window_width"]))
