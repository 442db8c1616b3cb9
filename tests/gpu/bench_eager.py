"""Eager-torch DeepSeek-V4-Flash cache pooling: the same math as the core's GPU path (window,
ratio-4 overlapped compressor, indexer compressor, ratio-128 compressor, RMSNorm, RoPE with
YaRN frequencies), written the way one would in PyTorch, for the throughput comparison that
core/examples/bench_gpu.rs prints. Random weights of the real shapes; not a correctness oracle.

    python3 tests/gpu/bench_eager.py --tokens 65536 --chunks 2048,8192 --step 2048
prints `eager chunk=C tok_s=X` per chunk size.
"""

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

H, HD, IHD, ROPE, WIN, EPS = 4096, 512, 128, 64, 128, 1e-6
RATIOS = [0, 0] + [4, 128] * 20 + [4]


def inv_freq(base, yarn, dims=ROPE):
    inv = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims))
    if yarn:
        factor, orig, bf, bs = 16.0, 65536.0, 32.0, 1.0
        cd = lambda rot: dims * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
        low, high = max(math.floor(cd(bf)), 0), min(math.ceil(cd(bs)), dims - 1)
        ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        inv = inv / factor * (1 - smooth) + inv * smooth
    return inv.cuda()


def rope(x, pos, inv):
    """Rotate the trailing ROPE features of x [n, d] (interleaved pairs) at positions pos [n]."""
    theta = pos[:, None].float() * inv[None, :]
    c, s = theta.cos(), theta.sin()
    t = x[:, -ROPE:].float().view(x.shape[0], ROPE // 2, 2)
    x1, x2 = t[..., 0], t[..., 1]
    r = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).view(x.shape[0], ROPE)
    return torch.cat((x[:, :-ROPE], r.to(x.dtype)), dim=1)


def rms(x, w):
    return F.rms_norm(x.float(), (x.shape[-1],), w, EPS).to(torch.bfloat16)


class Comp:
    def __init__(self, g, ratio, hd, col):
        self.r, self.hd, self.od, self.col = ratio, hd, (2 * hd if ratio == 4 else hd), col
        self.ape = torch.randn(ratio, self.od, device="cuda", generator=g) * 0.5
        self.norm = torch.ones(hd, device="cuda")
        self.inv = inv_freq(160000.0, True)
        self.stash = None  # raw (kv|gate) rows before `processed`
        self.pooled = []

    def feed(self, y, start, step):
        r, od, hd = self.r, self.od, self.hd
        raw = y[:, self.col : self.col + 2 * od]
        seq = raw if self.stash is None else torch.cat((self.stash, raw))
        seq0 = start - (0 if self.stash is None else self.stash.shape[0])
        end = start + y.shape[0]
        base0, nwin = start // r * r, end // r - start // r
        if nwin:
            win = seq[base0 - seq0 : base0 - seq0 + nwin * r].view(nwin, r, 2 * od)
            kv, gate = win[..., :od], win[..., od:]
            if r == 4:
                gate = gate + self.ape.to(torch.bfloat16)
                if base0 - seq0 >= r:
                    p = seq[base0 - seq0 - r : base0 - seq0].view(1, r, 2 * od)
                    pkv, pg = p[..., :od], p[..., od:] + self.ape.to(torch.bfloat16)
                else:
                    pkv = torch.zeros(1, r, od, dtype=kv.dtype, device=kv.device)
                    pg = torch.full((1, r, od), float("-inf"), dtype=kv.dtype, device=kv.device)
                prev_kv = torch.cat((pkv, kv[:-1]))[..., :hd]
                prev_g = torch.cat((pg, gate[:-1]))[..., :hd].clone()
                bases = base0 + r * torch.arange(nwin, device=y.device)
                fresh = (bases == 0) | ((bases - 1) // step != (bases + r - 1) // step)
                prev_g[fresh] = float("-inf")
                prev_kv = prev_kv * (~fresh)[:, None, None]
                g8 = torch.cat((prev_g, gate[..., hd:]), dim=1).float()
                k8 = torch.cat((prev_kv, kv[..., hd:]), dim=1)
                wts = torch.softmax(g8, dim=1).to(torch.bfloat16)
                pooled = (k8 * wts).float().sum(1).to(torch.bfloat16)
            else:
                wts = torch.softmax(gate.float() + self.ape, dim=1).to(torch.bfloat16)
                pooled = (kv * wts).float().sum(1).to(torch.bfloat16)
            pooled = rope(rms(pooled, self.norm), base0 // r + torch.arange(nwin, device=y.device), self.inv)
            self.pooled.append(pooled)
        rem = end % r
        keep = rem + (min(r, end - rem) if r == 4 else 0)
        self.stash = seq[seq.shape[0] - keep :].clone() if keep else None


class Layer:
    def __init__(self, g, i, step):
        ratio = RATIOS[i]
        n = HD
        self.comps = []
        if ratio:
            self.comps.append(Comp(g, ratio, HD, n))
            n += 2 * self.comps[-1].od
        if ratio == 4:
            self.comps.append(Comp(g, ratio, IHD, n))
            n += 2 * self.comps[-1].od
        self.w = (torch.randn(n, H, device="cuda", generator=g) / math.sqrt(H)).to(torch.bfloat16)
        self.kv_norm = torch.ones(HD, device="cuda")
        self.inv = inv_freq(10000.0, False) if ratio == 0 else inv_freq(160000.0, True)
        self.retain = WIN - 1 + step
        self.window = None
        self.step = step

    def feed(self, x, start):
        y = x @ self.w.t()
        c = x.shape[0]
        keep = min(c, self.retain)
        kv = rope(rms(y[c - keep :, :HD], self.kv_norm), start + c - keep + torch.arange(keep, device=x.device), self.inv)
        self.window = kv if self.window is None else torch.cat((self.window, kv))[-self.retain :]
        for comp in self.comps:
            comp.feed(y, start, self.step)


def run(tokens, chunk, step, x):
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [Layer(g, i, step) for i in range(len(RATIOS))]
    torch.cuda.synchronize()
    t = time.perf_counter()
    start = 0
    while start < tokens:
        c = min(chunk, tokens - start)
        for layer in layers:
            layer.feed(x[:c], start)
        start += c
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--chunks", default="2048,8192")
    ap.add_argument("--step", type=int, default=2048)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device for torch", file=sys.stderr)
        sys.exit(2)
    chunks = [int(c) for c in a.chunks.split(",")]
    x = torch.randn(max(chunks), H, device="cuda").to(torch.bfloat16)
    for c in chunks:
        run(2 * c, c, a.step, x)  # warm-up
        secs = run(a.tokens, c, a.step, x)
        print(f"eager chunk={c} tok_s={a.tokens / secs:.0f}", flush=True)


if __name__ == "__main__":
    main()
