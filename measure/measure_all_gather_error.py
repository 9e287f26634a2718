"""The error of quantizing real layers' weights for FSDP2's compressed all-gather
(issue 38): int8/6/4 blockwise with and without the codec's rotation against fp8 e4m3 at
the same bytes (``+rot``: every block rotated; ``+auto``: each block where that lowers its
max, hhook's default), on the bundled ``wide-cnn`` and ``gpt`` models, at initialization and
after ``--steps`` steps of their task's training (one process, the task's SGD).

For every parameter with at least two dimensions: the relative L2 error
``||w_hat - w|| / ||w||`` (its median and worst over the layers, and over the whole model),
and the change of the validation loss when every such weight is quantized at once
(embeddings included, and left dense). Writes a JSON file and prints tables::

    python3 measure/measure_all_gather_error.py --steps 300 --out bench/fsdp-all-gather-error.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hhook.profile.tasks import TASKS, batches
from hhook.codec.weights import WeightCodec

BLOCK = 256
E4M3_MAX = 448.0


def _blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    flat = w.detach().reshape(-1).float()
    n = flat.numel()
    padded = torch.zeros(-(-n // block) * block)
    padded[:n] = flat
    return padded.view(-1, block), n


def int_quant(bits: int, rotate: bool, block: int = BLOCK):
    codec = WeightCodec(bits, block, rotate, seed=0)

    def q(w):
        blocks, n = _blocks(w, block)
        payload = torch.empty(codec.nbytes(blocks.shape[0]), dtype=torch.uint8)
        codec.encode(blocks, payload)
        return codec.decode(payload, blocks.shape[0]).reshape(-1)[:n].view_as(w)

    return q


def fp8_quant(block: int | None):
    """e4m3 with one float32 scale per block (``block``) or per tensor (None), the block's
    max mapped to 448 (torchao's and ColossalAI's recipe, their tensor-wise scale)."""

    def q(w):
        blocks, n = _blocks(w, block or w.numel())
        scale = (blocks.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-30)
        y = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
        return y.reshape(-1)[:n].view_as(w)

    return q


METHODS = {
    "bf16": lambda w: w.to(torch.bfloat16).float(),
    "fp8-e4m3/block": fp8_quant(BLOCK), "fp8-e4m3/tensor": fp8_quant(None),
    **{f"int{b}{suffix}": int_quant(b, mode) for b in (8, 6, 4)
       for suffix, mode in (("", False), ("+rot", True), ("+auto", "auto"))},
    "int8+auto/B=1024": int_quant(8, "auto", 1024), "int4+auto/B=64": int_quant(4, "auto", 64),
}
BITS = {"bf16": 16, "fp8-e4m3/tensor": 8.0, "int8+auto/B=1024": 8 + 32 / 1024, "int4+auto/B=64": 4 + 32 / 64}


def bits_of(name: str) -> float:
    if name in BITS:
        return BITS[name]
    width = 8 if "fp8" in name or name.startswith("int8") else int(name[3])
    return width + 32 / BLOCK


def train(name: str, steps: int) -> tuple[torch.nn.Module, tuple]:
    task = TASKS[name]
    torch.manual_seed(0)
    model = task.build()
    x_train, y_train, x_test, y_test = task.load()
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9)
    for step, idx in enumerate(batches(torch.arange(len(x_train)), task.batch_size, None)):
        if step == steps:
            break
        out = model(x_train[idx])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y_train[idx].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, (x_test, y_test)


def val_loss(model, data) -> float:
    if data is None:
        return float("nan")
    x, y = data
    with torch.no_grad():
        out = model(x)
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).item()


def synthetic() -> tuple[torch.nn.Module, None]:
    """Weights with heavy tails, where the bundled models have none: Student-t (3 degrees
    of freedom) and Gaussian with 0.1% of the entries 30 times larger."""
    torch.manual_seed(0)  # StudentT samples from the global generator
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    t = torch.distributions.StudentT(3.0).sample((1024, 1024))
    outliers = torch.randn(1024, 1024, generator=g)
    mask = torch.rand(1024, 1024, generator=g) < 1e-3
    outliers[mask] *= 30
    model.student_t3 = torch.nn.Parameter(t)
    model.gauss_outliers = torch.nn.Parameter(outliers)
    return model, None


def measure(model, data) -> dict:
    weights = {n: p for n, p in model.named_parameters() if p.dim() >= 2}
    embeddings = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding) for n in [n + ".weight"]}
    exact = {n: p.detach().clone() for n, p in weights.items()}
    base = val_loss(model, data)
    rows = {}
    for method, q in METHODS.items():
        errs, num, den = {}, 0.0, 0.0
        quantized = {n: q(w) for n, w in exact.items()}
        for n, w in exact.items():
            d = (quantized[n] - w).norm().item()
            errs[n] = d / w.norm().item()
            num, den = num + d * d, den + w.norm().item() ** 2
        losses = {}
        for label, skip in (("all", set()), ("no_embeddings", embeddings)):
            with torch.no_grad():
                for n, p in weights.items():
                    p.copy_(exact[n] if n in skip else quantized[n])
            losses[label] = val_loss(model, data) - base
        with torch.no_grad():
            for n, p in weights.items():
                p.copy_(exact[n])
        ordered = sorted(errs.values())
        rows[method] = {"bits_per_value": bits_of(method), "model_rel_err": (num / den) ** 0.5,
                        "median_layer_rel_err": ordered[len(ordered) // 2], "worst_layer_rel_err": ordered[-1],
                        "worst_layer": max(errs, key=errs.get), "val_loss_delta": losses["all"],
                        "val_loss_delta_dense_embeddings": losses["no_embeddings"] if embeddings else None,
                        "layers": errs}
    return {"val_loss": base, "methods": rows}


def table(title: str, result: dict) -> str:
    lines = [f"{title} (val loss {result['val_loss']:.4f})",
             f"{'method':18s} {'bits':>6s} {'model':>9s} {'median':>9s} {'worst':>9s} {'dloss':>10s} {'dloss(emb dense)':>17s}"]
    for m, r in result["methods"].items():
        emb = r["val_loss_delta_dense_embeddings"]
        lines.append(f"{m:18s} {r['bits_per_value']:6.3f} {r['model_rel_err']:9.2e} {r['median_layer_rel_err']:9.2e} "
                     f"{r['worst_layer_rel_err']:9.2e} {r['val_loss_delta']:+10.2e} "
                     f"{'' if emb is None else f'{emb:+.2e}':>17s}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--models", default="wide-cnn,gpt")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    doc = {"block": BLOCK, "steps": args.steps, "models": {}}
    for name in filter(None, args.models.split(",")):
        for steps in (0, args.steps):
            t0 = time.perf_counter()
            model, data = train(name, steps)
            result = measure(model, data)
            doc["models"][f"{name}@{steps}"] = result
            print(table(f"{name} after {steps} steps ({time.perf_counter() - t0:.0f} s)", result), flush=True)
    result = doc["models"]["synthetic"] = measure(*synthetic())
    print(table("synthetic heavy tails (no loss)", result))
    for m, r in result["methods"].items():
        print(f"  {m:18s} " + "  ".join(f"{n} {e:.2e}" for n, e in r["layers"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
