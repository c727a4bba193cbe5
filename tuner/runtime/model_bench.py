"""`hgemm-tune bench-model DIR`: a packaged library inside a real model.

A Hugging Face `transformers` Llama built from a Llama-3-8B-sized config (hidden 4096,
intermediate 14336, 32 query and 8 KV heads, vocabulary 128256; random weights, a few layers:
nothing is downloaded), in fp16 on the GPU. The same model runs stock and with its nn.Linear
modules swapped for `torch.ops.hgemm.linear` (the swap changes the modules' class, the weights
are the same tensors), interleaved repeat by repeat so that both see the same clocks:

- prefill: one sequence of T tokens (the Linear layers see M = T);
- decode: B sequences of one new token each, without a KV cache (M = B; attention over one
  token is negligible next to the Linear layers, which is what this measures);

eager and replayed from a CUDA graph, each timed with CUDA events (median of the repeats). The
logits' max error against an fp32 copy of the model is reported for both, on the same input.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tuner.errors import UserError
from tuner.runtime.package import open_library, package_info

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)


@dataclass
class ModelRow:
    phase: str              # prefill | decode
    batch: int
    tokens: int             # per sequence
    M: int                  # rows every Linear layer sees
    mode: str               # eager | graph
    stock_ms: float | None
    ours_ms: float | None
    speedup: float | None
    linear_calls_ours: int  # Linear calls per forward that run a packaged kernel (the rest: the vendor)
    linear_calls: int
    stock_err: float | None = None   # logits max |fp16 - fp32| (eager rows)
    ours_err: float | None = None
    note: str = ""


@dataclass
class ModelReport:
    gpu: str
    torch: str
    transformers: str
    layers: int
    rows: list[ModelRow]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _time_ms(fn) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _interleaved(run: dict[bool, Any], repeats: int, prepare=None) -> tuple[float, float]:
    """Median ms of run[False] (stock) and run[True] (ours), timed in turns, the order alternating,
    so both see the same clocks; prepare(which), untimed, before each."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(repeats):
        for which in ((False, True) if r % 2 == 0 else (True, False)):
            if prepare:
                prepare(which)
            times[which].append(_time_ms(run[which]))
    return statistics.median(times[False]), statistics.median(times[True])


def bench_model(package_dir: str | Path, layers: int = 2, prefill: tuple[int, ...] = (512, 1024, 2048, 4096),
                decode: tuple[int, ...] = (1, 8, 32, 64), repeats: int = 20, graphs: bool = True,
                on_row=None) -> ModelReport:
    import torch

    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise UserError("bench-model needs transformers (pip install transformers)") from None
    from tuner.runtime import torch_op

    package_info(Path(package_dir))   # not a package: said before anything else
    if not torch.cuda.is_available():
        raise UserError("bench-model needs a CUDA GPU visible to torch")
    if layers < 1 or repeats < 3:
        raise UserError("--layers must be >= 1 and --repeats >= 3")
    start = time.perf_counter()
    package_dir = Path(package_dir).resolve()
    torch_op.load(package_dir)
    lib = open_library(package_dir)
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA3_8B, num_hidden_layers=layers,
                         max_position_embeddings=max((*prefill, 1)) + 16, attn_implementation="sdpa")
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.float16).eval()
    reference = copy.deepcopy(model).float()
    swapped = torch_op.swap_linear(model)
    tuned_class = type(model.get_submodule(swapped[0]))
    linears = [model.get_submodule(n) for n in swapped]

    def use(ours: bool) -> None:
        for mod in linears:
            mod.__class__ = tuned_class if ours else torch.nn.Linear

    cases = [("prefill", 1, t) for t in prefill] + [("decode", b, 1) for b in decode]
    rows: list[ModelRow] = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.inference_mode():
        for phase, batch, tokens in cases:
            ids = torch.randint(0, config.vocab_size, (batch, tokens), device="cuda", generator=gen)
            m = batch * tokens
            ours_calls = sum(1 for mod in linears if lib.hgemm_tuned_lookup(m, mod.out_features, mod.in_features) >= 0)

            def forward(ids=ids):
                return model(input_ids=ids, use_cache=False).logits

            ref = reference(input_ids=ids, use_cache=False).logits
            use(False)
            stock_err = float((forward().float() - ref).abs().max())
            use(True)
            ours_err = float((forward().float() - ref).abs().max())
            del ref
            s, o = _interleaved({False: forward, True: forward}, repeats, prepare=use)
            row = ModelRow(phase, batch, tokens, m, "eager", s, o, s / o, ours_calls, len(linears), stock_err, ours_err)
            rows.append(row)
            if on_row:
                on_row(row)
            if graphs:
                rows.append(_graph_row(phase, batch, tokens, m, forward, use, repeats, ours_calls, len(linears)))
                if on_row:
                    on_row(rows[-1])
            torch.cuda.empty_cache()
    use(True)
    return ModelReport(torch.cuda.get_device_name(), torch.__version__, transformers.__version__, layers, rows,
                       time.perf_counter() - start)


def _graph_row(phase, batch, tokens, m, forward, use, repeats, ours_calls, n_linear) -> ModelRow:
    from tuner.runtime.torch_op import graphed

    replays = {}
    try:
        for which in (False, True):
            use(which)
            replays[which], _ = graphed(forward, warmups=2)
    except Exception as exc:  # noqa: BLE001 - a model that cannot be captured is a row that says why
        return ModelRow(phase, batch, tokens, m, "graph", None, None, None, ours_calls, n_linear,
                        note=f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    s, o = _interleaved(replays, repeats)
    return ModelRow(phase, batch, tokens, m, "graph", s, o, s / o, ours_calls, n_linear)
