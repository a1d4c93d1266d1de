"""Resumable translator training: the state of a run between optimizer steps, in one safetensors file.

A run of ``mot-cag train`` on a CPU takes tens of minutes per pair, so it keeps its state next to its output
folder (``<out>.partial/train-state.safetensors``) every few steps and when it is interrupted, and a rerun of the
same command continues from there. The file holds the translator's tensors (calibration buffers included),
the optimizer's moment tensors and the torch RNG state; its metadata (JSON) holds the step, how many text pairs
the example stream has drawn (a resumed stream skips them without preparing them), the learning-rate schedule,
the history so far and a key of the settings: a state written under other settings is refused, never mixed in.
The file is replaced atomically, so a crash while writing leaves the previous state.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mot_cag.errors import MotCagError

STATE_FILE = "train-state.safetensors"
_FORMAT = "mot-cag-train-state"


def state_dir_for(out: str | Path) -> Path:
    """Where a run that writes ``out`` keeps its partial state."""
    out = Path(out)
    return out.parent / (out.name + ".partial")


def settings_key(cfg, translator) -> str:
    """A short hash of everything that shapes a run: training settings and the translator's architecture."""
    train = {k: v for k, v in asdict(cfg).items() if k not in ("log_every", "checkpoint_every")}
    arch = {k: v for k, v in translator.config.to_dict().items() if k != "training"}
    blob = json.dumps({"train": train, "translator": arch}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class TrainState:
    """Where a run stands after ``step`` optimizer steps.

    Attributes:
        step: Optimizer steps done.
        pairs_used: Text pairs the example stream had drawn after that step.
        key: :func:`settings_key` of the run.
        calibration: The calibration summary (computed once, before step 1).
        history: Log records so far.
        running: Loss sums since the last log record.
    """

    step: int
    pairs_used: int
    key: str
    calibration: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    running: dict = field(default_factory=dict)


def save_state(directory: Path, state: TrainState, translator, opt: torch.optim.Optimizer, sched) -> Path:
    """Write ``state`` with the translator, optimizer and RNG tensors (atomic replace)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in translator.state_dict().items()}
    osd = opt.state_dict()
    for idx, slots in osd["state"].items():
        for name, value in slots.items():
            tensors[f"opt.{idx}.{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    meta = {"state": asdict(state), "param_groups": osd["param_groups"], "scheduler": sched.state_dict()}
    tmp = directory / (STATE_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": _FORMAT, "meta": json.dumps(meta, default=str)})
    os.replace(tmp, directory / STATE_FILE)
    return directory / STATE_FILE


def load_state(directory: Path, key: str) -> tuple[TrainState, dict, dict] | None:
    """The saved state of a run with settings ``key``, or ``None`` when there is none.

    Returns:
        ``(state, tensors, meta)``: tensors by name, meta with ``param_groups`` and ``scheduler``.

    Raises:
        MotCagError: The file is damaged or was written by a run with other settings.
    """
    path = directory / STATE_FILE
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:  # one read: header metadata and tensors
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        meta = json.loads(header["meta"])
        state = TrainState(**meta["state"])
    except (SafetensorError, OSError, KeyError, TypeError, ValueError) as e:
        raise MotCagError(f"The saved training state {path} is damaged ({e}); delete {directory} to start over.") \
            from None
    if header.get("format") != _FORMAT:
        raise MotCagError(f"{path} is not a mot-cag training state; delete {directory} to start over.")
    if state.key != key:
        raise MotCagError(f"{directory} holds a partial run with other settings (steps, data, seed or translator "
                          f"shape differ); rerun with those settings to finish it, or delete {directory} to "
                          "start over.")
    return state, tensors, meta


def restore(translator, opt: torch.optim.Optimizer, sched, tensors: dict, meta: dict) -> None:
    """Put the saved translator weights, optimizer moments, schedule and RNG state back."""
    device = next(translator.parameters()).device
    translator.load_state_dict({k[len("model."):]: v.to(device) for k, v in tensors.items()
                                if k.startswith("model.")})
    slots: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("opt."):
            _, idx, slot = name.split(".", 2)
            slots.setdefault(int(idx), {})[slot] = value if slot == "step" else value.to(device)
    opt.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})
    sched.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
