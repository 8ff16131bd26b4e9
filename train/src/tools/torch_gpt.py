"""The PyTorch eager reference of ember's training step, for `ember bench train --against-torch`.

The same GPT-2 as ember's `Gpt` (learned positions, pre-norm blocks, fused c_attn, causal
scaled-dot-product attention, GELU (tanh) MLP of width 4d, final LayerNorm, head tied to
wte) and the same step (mean cross-entropy over the batch, backward, global-norm clipping at
1.0, AdamW with betas (0.9, 0.95), eps 1e-8 and weight decay 0.1 on 2-D weights only).
Initialisation and data do not matter for speed: weights are normal(0, 0.02), tokens are
uniform. Runs on the CPU or a CUDA GPU (`--device`), eager or under `torch.compile`
(`--compile`). f32 products run in IEEE f32, PyTorch's default, or on tensor cores as TF32
(`--tf32`, as `torch.set_float32_matmul_precision("high")`). Prints one JSON object: the median
step time of the timed steps, tokens/s and, on a GPU, the peak memory PyTorch's allocator held.
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def write_kernels(path, step, device, steps=3):
    """Each kernel's launches and device seconds per step over `steps` profiled steps: on a GPU
    the device kernels torch.profiler saw, on the CPU the operators without children."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    kernels = {}
    for e in prof.key_averages():
        if on_gpu:
            if e.device_type != DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = e.self_cuda_time_total
        else:
            us = e.self_cpu_time_total
        if us > 0:
            kernels[e.key] = {"launches": e.count / steps, "seconds": us * 1e-6 / steps}
    with open(path, "w") as f:
        json.dump({"device": str(device), "steps": steps, "kernels": kernels}, f)


def main():
    a = argparse.ArgumentParser(description=__doc__)
    for flag in ["n-layer", "n-head", "n-embd", "block-size", "batch-size", "vocab-size"]:
        a.add_argument("--" + flag, type=int, required=True)
    a.add_argument("--steps", type=int, default=20)
    a.add_argument("--warmup", type=int, default=3)
    a.add_argument("--threads", type=int, default=0)
    a.add_argument(
        "--dtype",
        choices=["f32", "bf16"],
        default="f32",
        help="bf16: the forward pass under autocast to bfloat16 (f32 weights and optimizer)",
    )
    a.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    a.add_argument(
        "--compile",
        action="store_true",
        help="the model under torch.compile (its compilation falls in the warm-up steps)",
    )
    a.add_argument(
        "--tf32",
        action="store_true",
        help="f32 products on tensor cores as TF32 (PyTorch's matmul precision 'high'); without "
        "it, IEEE f32 ('highest', the default)",
    )
    a.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile 3 more with torch.profiler and print its table",
    )
    a.add_argument(
        "--kernels",
        metavar="FILE",
        help="after the timed steps, profile 3 more and write FILE: one JSON object of each "
        "device kernel's launches and seconds per step (CUDA), or each operator's (CPU)",
    )
    args = a.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision("high" if args.tf32 else "highest")
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = Gpt(args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size)
    model = model.to(device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    shape = (args.batch_size, args.block_size)
    forward = torch.compile(model) if args.compile else model

    def step():
        idx = torch.randint(args.vocab_size, shape, device=device)
        targets = torch.randint(args.vocab_size, shape, device=device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss = forward(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # `item` waits for the step's kernels on a GPU, so the time covers them.
        if not math.isfinite(loss.item()):
            raise SystemExit(f"loss is {loss.item()}")
        return time.perf_counter() - t0

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [step() for _ in range(args.warmup + args.steps)][args.warmup :]
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            for _ in range(3):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if args.kernels:
        write_kernels(args.kernels, step, device)
    median = statistics.median(times)
    print(
        json.dumps(
            {
                "params": sum(p.numel() for p in model.parameters()),
                "threads": torch.get_num_threads(),
                "step_ms_median": 1e3 * median,
                "tokens_per_s": args.batch_size * args.block_size / median,
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "compiled": args.compile,
                "f32_matmul_precision": torch.get_float32_matmul_precision(),
                "peak_device_bytes": (
                    torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
