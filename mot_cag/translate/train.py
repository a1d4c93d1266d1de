"""Training translators: frozen source and target, only the translator learns.

One example is a ``(context, continuation)`` text pair. The source prefills the context; the translator turns
that cache into the target's; the target reads the continuation over it. Losses (weights configurable, so
the ablations CE-only / CCL-only / both are flags):

* ``ce``: prompt-LM cross-entropy of the continuation's tokens read over the translated cache;
* ``ccl``: Context Correction Loss — per-layer relative MSE (MSE / variance of the native tensor) between the
  target's K/V along the translated trajectory (context cache + continuation) and along the native one
  (target over its own prefill), from the first injected layer up;
* ``kl``: KL(native || translated) of the target's next-token distributions over the continuation, a
  distillation term beyond the paper;
* ``balance``: importance CV² of the routers (keeps experts in use).

Defaults are CCL + 5 x KL without CE, chosen on the zoo sweeps recorded in ``mot_cag/zoo/translators/RESULTS.md``
(there the paper's CE + CCL pulled the translated cache away from the native one: CE rewards a cache that helps
the target beyond its own context). ``--ce 1 --ccl 1 --kl 0`` reproduces the paper's loss.

AdamW, linear warmup then cosine decay, gradient clipping, seeded; runs where the target runs (CUDA when the
caller loaded it there).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from mot_cag.models.cache import KVChunk, forward, prefill
from mot_cag.names import COVERAGES, choose
from mot_cag.prompts import prompt_format
from mot_cag.translate.alignment import token_alignment
from mot_cag.translate.data import Pair, pair_stream
from mot_cag.translate.inject import translate
from mot_cag.translate.mot import Translator


@dataclass
class TrainConfig:
    """Optimisation settings of :func:`train_translator`.

    Attributes:
        steps: Optimizer steps.
        batch: Examples per step (gradients accumulated).
        lr: Peak learning rate.
        warmup: Linear warmup steps.
        weight_decay: AdamW weight decay.
        grad_clip: Max gradient norm.
        ce: Weight of the prompt-LM cross-entropy.
        ccl: Weight of the Context Correction Loss.
        kl: Weight of the KL-to-native distillation term.
        balance: Weight of the router load-balance loss.
        seed: Seeds data order and initialisation.
        data: ``synthetic`` or a JSONL/text file.
        repeat_prob: Share of repeat-task examples in synthetic data.
        init: ``ridge`` (closed-form fit of the linear part first) or ``identity``.
        linear_lr: Learning-rate multiplier (and no weight decay) for the experts' linear parts when they start
            from the ridge fit: at the full rate AdamW walks away from the closed-form optimum in a few steps
            (measured on the zoo: held-out KL rose 5x in 40 steps).
        calibration_tokens: Target tokens used to calibrate normalisation (and fit the ridge init).
        ridge_lambda: Ridge regularisation (relative to the mean feature energy).
        max_context_tokens: Longer contexts are cut (source tokens).
        random_start: Probability of placing the context at a random position (absolute-position targets), so
            the translator learns to write K/V for chunks that do not start at 0.
        plain_chunk: Probability of tokenizing the source context without special tokens (as a stored chunk
            may be); the target side always starts with its own specials, computed natively.
        chunk_prefix: ``none`` (contexts prefilled alone, as in prefix-free stores) or ``prompt``: every source
            context is prefilled after the source's prompt head and every native target context after the
            target's, the separator appended, as a prefixed store's chunks are made and read
            (:data:`mot_cag.config.CHUNK_PREFIXES`). ``auto`` (resolved by :func:`run_training`): ``prompt`` when
            both models would make prefixed stores (RoPE models with a chat or completion prompt).
        log_every: Steps between log records.
        checkpoint_every: Steps between saved training states when the run has a state folder (resumable
            runs, :mod:`mot_cag.translate.resume`); 0 saves only on an interrupt.
    """

    steps: int = 300
    batch: int = 4
    lr: float = 2e-3
    warmup: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ce: float = 0.0
    ccl: float = 1.0
    kl: float = 5.0
    balance: float = 0.01
    seed: int = 0
    data: str = "synthetic"
    repeat_prob: float = 0.3
    init: str = "ridge"
    linear_lr: float = 0.02
    calibration_tokens: int = 4096
    ridge_lambda: float = 1e-2
    max_context_tokens: int = 384
    random_start: float = 0.25
    plain_chunk: float = 0.5
    chunk_prefix: str = "none"
    log_every: int = 10
    checkpoint_every: int = 10
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch < 1:
            raise ValueError("steps must be >= 0 and batch >= 1.")
        if min(self.ce, self.ccl, self.kl, self.balance) < 0 or self.ce + self.ccl + self.kl == 0:
            raise ValueError("Loss weights must be >= 0 with at least one of ce, ccl, kl positive.")
        if self.init not in ("ridge", "identity"):
            raise ValueError("init must be 'ridge' or 'identity'.")
        if self.chunk_prefix not in ("auto", "none", "prompt"):
            raise ValueError("chunk_prefix must be 'auto', 'none' or 'prompt'.")


@dataclass
class Example:
    """One prepared example (everything that does not depend on the translator, computed once).

    Attributes:
        src_chunk: Source KV of the context ``[L_s, H_s, T_s, D_s]`` at start 0.
        W: ``[T_t, T_s]`` alignment.
        tgt_ids: ``[T_t]`` target context ids.
        cont_ids: ``[T_c]`` target continuation ids.
        start: Target position of the context's first token.
        native_full: Target's own KV over context + continuation ``[L_t, H_t, T_t + T_c, D_t]``.
        native_logits: ``[T_c, vocab]`` target logits over the continuation with its own context.
        head: The target's prompt head KV that stands before the context (prefixed examples), else ``None``.
    """

    src_chunk: KVChunk
    W: torch.Tensor
    tgt_ids: torch.Tensor
    cont_ids: torch.Tensor
    start: int
    native_full: KVChunk
    native_logits: torch.Tensor
    head: KVChunk | None = None

    def with_head(self, ctx: KVChunk) -> KVChunk:
        """``ctx`` (the context's cache) with the head's KV before it, when there is a head."""
        from mot_cag.models.cache import join

        return ctx if self.head is None else join([self.head.to(ctx.keys.device), ctx])

    def after_head(self, full: KVChunk) -> KVChunk:
        """``full`` without the head's rows."""
        return full if self.head is None else full.slice(self.head.length, full.length)


@dataclass
class Heads:
    """The prompt heads a prefixed example's contexts are prefilled after (see ``TrainConfig.chunk_prefix``).

    Attributes:
        source: Source head KV (source chunks are made after it and moved back to position 0, as ingest does).
        target: Target head KV (native target contexts follow it, at ``target.end``).
        separator: Text appended to every context (the prompt format's piece separator).
    """

    source: KVChunk
    target: KVChunk
    separator: str

    @classmethod
    @torch.no_grad()
    def of(cls, source, target) -> Heads:
        """Both models' prompt heads; both formats must have one and share the separator."""
        sp, tp = prompt_format(source), prompt_format(target)
        if not sp.head or not tp.head or sp.separator != tp.separator:
            raise ValueError(f"chunk_prefix 'prompt' needs both models to have a prompt head and one separator "
                             f"({source.name}: {len(sp.head)} head tokens, separator {sp.separator!r}; "
                             f"{target.name}: {len(tp.head)}, {tp.separator!r}).")
        src = prefill(source.model, torch.tensor(sp.head, device=source.device))
        tgt = prefill(target.model, torch.tensor(tp.head, device=target.device))
        return cls(src, tgt, sp.separator)


@torch.no_grad()
def prepare_example(source, target, pair: Pair, max_context_tokens: int = 384, start: int = 0,
                    max_continuation_tokens: int = 128, src_special_tokens: bool = True,
                    heads: Heads | None = None) -> Example | None:
    """Tokenize, align, prefill the source and run the native target; ``None`` if the pair is unusable.

    The target side always gets its specials (its ``</s>`` leads every context and is computed natively);
    ``src_special_tokens=False`` tokenizes the source side as a stored chunk without them. Contexts longer
    than ``max_context_tokens`` (or than the target's position limit allows) are cut at a character
    boundary; continuations are cut to ``max_continuation_tokens``. With ``heads`` the context (plus the
    separator) is tokenized without specials on both sides, the source prefills it after its head (moved back
    to position 0, as a prefixed store holds it) and the target after its own (``start`` = head length).
    """
    context, continuation = pair
    if heads is not None:
        start = heads.target.length
    cont_ids = torch.tensor(target.tokenizer(continuation, add_special_tokens=False)["input_ids"], dtype=torch.long)
    cont_ids = cont_ids[:max_continuation_tokens]
    budget = min(max_context_tokens, target.layout.max_positions - start - len(cont_ids),
                 source.layout.max_positions)
    if budget < 4 or len(cont_ids) < 2:
        return None
    context = context[: 8 * budget]
    sep = heads.separator if heads is not None else ""
    while True:
        if heads is None:
            al = token_alignment(source.tokenizer, target.tokenizer, context, src_special_tokens=src_special_tokens)
        else:
            al = token_alignment(source.tokenizer, target.tokenizer, context + sep, add_special_tokens=False)
        if max(len(al.src_ids), len(al.tgt_ids)) <= budget:
            break
        context = context[: int(len(context) * 0.85)]
    if len(al.tgt_ids) == 0 or len(al.src_ids) == 0:
        return None
    if heads is None:
        src_chunk = prefill(source.model, al.src_ids.to(source.device))
        native_ctx = prefill(target.model, al.tgt_ids.to(target.device), start=start)
        logits, native_full = forward(target.model, cont_ids.to(target.device), native_ctx)
        return Example(src_chunk.to(target.device), al.W, al.tgt_ids, cont_ids, start, native_full, logits)
    from mot_cag.models.cache import join, prefill_after
    from mot_cag.models.positions import Positioner

    made = prefill_after(source.model, al.src_ids.to(source.device), heads.source)
    src_chunk = Positioner(source.layout, source.model.config).reposition(made, 0)
    native_ctx = prefill_after(target.model, al.tgt_ids.to(target.device), heads.target)
    logits, full = forward(target.model, cont_ids.to(target.device), join([heads.target, native_ctx]))
    native_full = full.slice(heads.target.length, full.length)
    return Example(src_chunk.to(target.device), al.W, al.tgt_ids, cont_ids, start, native_full, logits, heads.target)


def _relative_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-layer MSE of ``a`` against ``b`` ``(L, H, T, D)``, divided by ``b``'s variance, averaged."""
    mse = (a - b).pow(2).mean(dim=(1, 2, 3))
    return (mse / b.var(dim=(1, 2, 3)).clamp_min(1e-6)).mean()


def _kl(native_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(native || other) of the next-token distributions."""
    return F.kl_div(logits.float().log_softmax(-1), native_logits.float().log_softmax(-1), log_target=True,
                    reduction="batchmean")


def loss_terms(translator: Translator, ex: Example, target, injection: str | None = None) -> dict[str, torch.Tensor]:
    """The differentiable loss terms of one example."""
    injection = injection or translator.config.coverage
    ctx = translate(translator, ex.src_chunk, ex.W, target, ex.tgt_ids.to(target.device), ex.start, injection)
    logits, full = forward(target.model, ex.cont_ids.to(target.device), ex.with_head(ctx))
    full = ex.after_head(full)
    cont = ex.cont_ids.to(logits.device)
    first = 0 if injection == "inject-all" else translator.config.layers.window_start
    ccl = (_relative_mse(full.keys[first:], ex.native_full.keys[first:])
           + _relative_mse(full.values[first:], ex.native_full.values[first:])) / 2
    return {
        "ce": F.cross_entropy(logits[:-1].float(), cont[1:]),
        "ccl": ccl,
        "kl": _kl(ex.native_logits, logits),
        "balance": translator.balance_loss(),
    }


def _schedule(step: int, cfg: TrainConfig) -> float:
    """LR multiplier: linear warmup, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _param_groups(translator: Translator, cfg: TrainConfig) -> list[dict]:
    """The ridge-fitted shared linear maps at ``linear_lr`` x the rate, without weight decay; experts and
    routers at the full rate."""
    slow, fast = [], []
    for name, p in translator.named_parameters():
        if p.requires_grad:
            (slow if cfg.init == "ridge" and ".base." in name else fast).append(p)
    groups = [{"params": fast}]
    if slow:
        groups.append({"params": slow, "lr": cfg.lr * cfg.linear_lr, "weight_decay": 0.0})
    return groups


class ExampleStream:
    """Endless prepared examples from ``cfg.data``.

    ``pairs_used`` counts the text pairs drawn so far, usable or not; a stream made with ``skip=n`` draws (and
    discards, unprepared) the first ``n`` pairs and their random choices, so a resumed run continues with the
    examples the interrupted one would have seen next.
    """

    def __init__(self, source, target, cfg: TrainConfig, seed: int | None = None, skip: int = 0):
        seed = cfg.seed if seed is None else seed
        self.source, self.target, self.cfg = source, target, cfg
        self.rng = random.Random(seed)
        self.heads = Heads.of(source, target) if cfg.chunk_prefix == "prompt" else None
        self.pairs = iter(pair_stream(cfg.data, seed, cfg.repeat_prob))
        self.pairs_used = 0
        for _ in range(skip):
            self._draw()

    def _draw(self) -> tuple[Pair, int, bool]:
        pair = next(self.pairs)
        self.pairs_used += 1
        start = 0
        if self.target.layout.positions == "absolute" and self.rng.random() < self.cfg.random_start:
            start = self.rng.randint(1, max(1, self.target.layout.max_positions // 4))
        return pair, start, self.rng.random() < self.cfg.plain_chunk

    def __iter__(self) -> ExampleStream:
        return self

    def __next__(self) -> Example:
        while True:
            pair, start, plain = self._draw()
            ex = prepare_example(self.source, self.target, pair, self.cfg.max_context_tokens, start,
                                 src_special_tokens=not plain, heads=self.heads)
            if ex is not None:
                return ex


def example_stream(source, target, cfg: TrainConfig, seed: int | None = None) -> Iterable[Example]:
    """Endless prepared examples from ``cfg.data`` (:class:`ExampleStream`)."""
    return ExampleStream(source, target, cfg, seed)


def train_translator(
    translator: Translator,
    source,
    target,
    cfg: TrainConfig,
    log: Callable[[dict], None] | None = None,
    state_dir: str | Path | None = None,
) -> dict:
    """Train ``translator`` in place (source and target stay frozen).

    Args:
        translator: From :func:`~mot_cag.translate.mot.build_translator`, on the target's device.
        source: Source loaded model.
        target: Target loaded model.
        cfg: Settings.
        log: Called with a record every ``cfg.log_every`` steps (step, loss terms, lr, router balance, seconds),
            and with ``{"resumed_from": step}`` when a saved state is picked up.
        state_dir: Keep a resumable state here (every ``cfg.checkpoint_every`` steps and on an interrupt) and
            continue from the one found there (:mod:`mot_cag.translate.resume`); ``None``: not resumable.

    Returns:
        A training summary (also stored in ``translator.config.training``).

    Raises:
        MotCagError: The saved state is damaged or belongs to a run with other settings.
    """
    from mot_cag.translate import resume

    torch.manual_seed(cfg.seed)
    t0 = time.time()
    state_dir = Path(state_dir) if state_dir is not None else None
    state, saved = _begin(translator, source, target, cfg, state_dir)
    resumed_from = state.step if saved is not None else None
    params = [p for p in translator.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(_param_groups(translator, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, cfg))
    if saved is not None:
        resume.restore(translator, opt, sched, *saved)
        if log is not None:
            log({"resumed_from": state.step})
    stream = ExampleStream(source, target, cfg, skip=state.pairs_used)
    weights = {"ce": cfg.ce, "ccl": cfg.ccl, "kl": cfg.kl, "balance": cfg.balance}
    translator.train()
    try:
        for step in range(state.step, cfg.steps):
            _train_step(translator, target, stream, opt, cfg, weights, state.running)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            opt.step()
            sched.step()
            state.step, state.pairs_used = step + 1, stream.pairs_used
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                _log_record(state, cfg, translator, sched.get_last_lr()[0], grad_norm, t0, log)
            # The last step too: an interrupt during the held-out scoring after it then loses no training.
            if state_dir is not None and cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0
                                                                   or step + 1 == cfg.steps):
                resume.save_state(state_dir, state, translator, opt, sched)
    except KeyboardInterrupt:
        # The last completed step is a consistent state (a half-accumulated batch is dropped).
        if state_dir is not None and state.step > (resumed_from or 0):
            resume.save_state(state_dir, state, translator, opt, sched)
        raise
    translator.eval()
    summary = {"config": asdict(cfg), "calibration": state.calibration, "steps": cfg.steps,
               "seconds": round(time.time() - t0, 1), "final": state.history[-1] if state.history else {},
               "history": state.history}
    if resumed_from is not None:
        summary["resumed_from"] = resumed_from
    translator.config.training = summary
    return summary


def _begin(translator: Translator, source, target, cfg: TrainConfig, state_dir: Path | None):
    """Where a run starts: the saved state in ``state_dir`` (with its tensors and metadata), or step 0 after
    calibrating the translator (and fitting its ridge start)."""
    from mot_cag.translate import resume
    from mot_cag.translate.ridge import calibrate

    key = resume.settings_key(cfg, translator)
    saved = resume.load_state(state_dir, key) if state_dir is not None else None
    if saved is not None:
        return saved[0], saved[1:]
    calib = calibrate(translator, example_stream(source, target, cfg, seed=cfg.seed + 10_000), cfg.calibration_tokens,
                      fit=cfg.init == "ridge", ridge_lambda=cfg.ridge_lambda, target=target)
    return resume.TrainState(step=0, pairs_used=0, key=key, calibration=calib), None


def _log_record(state, cfg: TrainConfig, translator: Translator, lr: float, grad_norm: float, t0: float,
                log: Callable[[dict], None] | None) -> dict:
    """The log record of the steps since the last one (means of the running sums, which it resets), passed to
    ``log``."""
    n = cfg.log_every if state.step % cfg.log_every == 0 else state.step % cfg.log_every
    record = {"step": state.step, **{k: v / n for k, v in state.running.items()}, "lr": lr, "grad_norm": grad_norm,
              "seconds": round(time.time() - t0, 1), **translator.balance()}
    state.history.append(record)
    state.running = {}
    if log is not None:
        log(record)
    return record


def _train_step(translator: Translator, target, stream: ExampleStream, opt, cfg: TrainConfig, weights: dict,
                running: dict) -> None:
    """One step's gradients: ``cfg.batch`` examples accumulated; loss terms added to ``running``."""
    opt.zero_grad(set_to_none=True)
    for _ in range(cfg.batch):
        terms = loss_terms(translator, next(stream), target)
        loss = sum(weights[k] * v for k, v in terms.items() if weights[k] > 0)
        (loss / cfg.batch).backward()
        for k, v in terms.items():
            running[k] = running.get(k, 0.0) + float(v.detach()) / cfg.batch
        running["loss"] = running.get("loss", 0.0) + float(loss.detach()) / cfg.batch


# ------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_translator(
    translator: Translator, source, target, pairs: Iterable[Pair], injection: str | None = None,
    max_context_tokens: int = 384, heads: Heads | None = None,
) -> dict:
    """Held-out fidelity over continuations: KL to the native target and the context benefit kept.

    For each pair the target reads the continuation (teacher-forced, first token excluded from scores) over
    its own prefill (native), over the translated cache, and with no context. Returns means of
    ``kl_translated`` = KL(native || translated), ``kl_none``, ``kl_benefit`` = 1 - kl_translated / kl_none,
    ``nll_native``, ``nll_translated``, ``nll_none``, ``nll_benefit`` = (none - translated) / (none - native),
    ``top1_agreement`` (translated argmax = native argmax) and ``n``. With ``heads`` (prefixed examples,
    ``inject-all`` only) every context follows the target's head, and "no context" is the head alone.
    """
    injection = choose("injection", injection or translator.config.coverage, COVERAGES, ValueError)
    if heads is not None and injection != "inject-all":
        raise ValueError("prefixed examples are scored with inject-all only (replay runs without the head; "
                         "measure replay-joint through the pipeline).")
    sums = {"kl_translated": 0.0, "kl_none": 0.0, "nll_native": 0.0, "nll_translated": 0.0, "nll_none": 0.0,
            "top1_agreement": 0.0}
    n = 0
    for pair in pairs:
        ex = prepare_example(source, target, pair, max_context_tokens, heads=heads)
        if ex is None:
            continue
        ctx = translate(translator, ex.src_chunk, ex.W, target, ex.tgt_ids.to(target.device), ex.start, injection)
        cont = ex.cont_ids.to(target.device)
        logits, _ = forward(target.model, cont, ex.with_head(ctx), keep_cache=False)
        none, _ = forward(target.model, cont, ex.head, keep_cache=False)
        sl = slice(0, -1)
        sums["kl_translated"] += float(_kl(ex.native_logits[sl], logits[sl]))
        sums["kl_none"] += float(_kl(ex.native_logits[sl], none[sl]))
        for name, lg in (("nll_native", ex.native_logits), ("nll_translated", logits), ("nll_none", none)):
            sums[name] += float(F.cross_entropy(lg[:-1].float(), cont[1:]))
        sums["top1_agreement"] += float((logits[sl].argmax(-1) == ex.native_logits[sl].argmax(-1)).float().mean())
        n += 1
    out = {k: v / max(n, 1) for k, v in sums.items()}
    # Undefined ratios (no examples, or a context with no effect) are None, which JSON can carry.
    out["kl_benefit"] = 1 - out["kl_translated"] / out["kl_none"] if out["kl_none"] > 0 else None
    gap = out["nll_none"] - out["nll_native"]
    out["nll_benefit"] = (out["nll_none"] - out["nll_translated"]) / gap if abs(gap) > 1e-9 else None
    out["n"] = n
    return out
