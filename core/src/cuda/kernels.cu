// pd-bridge GPU kernels (compiled at run time by NVRTC with --fmad=false, IEEE div/sqrt, no FTZ).
// Every kernel mirrors one function of core/src/numerics.rs or core/src/pooler/*.rs, operation
// by operation, so that given the same projection outputs the results are bit-identical to the
// CPU reference. bf16 is handled as raw 16-bit patterns (no cuda_bf16.h needed).

typedef unsigned short bf16;

__device__ __forceinline__ float widen(bf16 x) { return __uint_as_float(((unsigned)x) << 16); }

// Round to nearest, ties to even (half::bf16::from_f32).
__device__ __forceinline__ bf16 rnd(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}
__device__ __forceinline__ float rndf(float f) { return widen(rnd(f)); }
// One step of the pooling sum (Compressor's pool_add): an f32 accumulator rounded once at the
// end (mlx 0.32.3, the fork), or a bf16 accumulator with every partial rounded (mlx 0.32.0,
// upstream oMLX 0.6.3: PoolSum::Bf16).
__device__ __forceinline__ float pool_add(int bf16_sum, float acc, float p) { return bf16_sum ? rndf(acc + p) : acc + p; }

// numerics::mlx_sincos (MLX's CPU Cephes sincos; libm past |x| > 2^23, where a double sincos
// rounded to float stands in for the host's sinf/cosf).
__device__ void mlx_sincos(float v, float* so, float* co) {
    if (fabsf(v) > 8388608.0f) {
        double sd, cd;
        sincos((double)v, &sd, &cd);
        *so = (float)sd;
        *co = (float)cd;
        return;
    }
    float x = fabsf(v);
    float y = x * 1.27323954473516f;
    unsigned emm2 = (((unsigned)y) + 1u) & ~1u;
    y = (float)emm2;
    bool poly_sin_first = (emm2 & 2u) != 0;
    x = fmaf(y, -0.78515625f, x);
    x = fmaf(y, -2.4187564849853515625e-4f, x);
    x = fmaf(y, -3.77489497744594108e-8f, x);
    bool neg_sin = (v < 0.0f) != ((emm2 & 4u) != 0);
    bool pos_cos = ((emm2 - 2u) & 4u) != 0;
    float z = x * x;
    float y1 = fmaf(z, 2.443315711809948e-5f, -1.388731625493765e-3f);
    float y2 = fmaf(z, -1.9515295891e-4f, 8.3321608736e-3f);
    y1 = fmaf(y1, z, 4.166664568298827e-2f);
    y2 = fmaf(y2, z, -1.6666654611e-1f);
    y1 = y1 * z;
    y2 = y2 * z;
    y1 = y1 * z;
    y2 = fmaf(x, y2, x);
    y1 = fmaf(z, -0.5f, y1);
    y1 = y1 + 1.0f;
    float ys = poly_sin_first ? y1 : y2;
    float yc = poly_sin_first ? y2 : y1;
    *so = neg_sin ? -ys : ys;
    *co = pos_cos ? yc : -yc;
}

// numerics::mlx_exp
__device__ float mlx_exp(float x) {
    if (x != x) return x;
    if (x > 88.0f) return __int_as_float(0x7f800000);
    if (x < -88.0f) return 0.0f;
    float t = x * 1.442695f;
    float ip = floorf(t + 0.5f);
    float fp = t - ip;
    float p = 1.535336188319500e-4f;
    p = fmaf(p, fp, 1.339887440266574e-3f);
    p = fmaf(p, fp, 9.618437357674640e-3f);
    p = fmaf(p, fp, 5.550332471162809e-2f);
    p = fmaf(p, fp, 2.402264791363012e-1f);
    p = fmaf(p, fp, 6.931472028550421e-1f);
    p = fmaf(p, fp, 1.0f);
    unsigned e = ((unsigned)((int)ip + 127)) << 23;
    return __uint_as_float(e) * p;
}

// numerics::linear, exactly: y[r, j] = bf16(sequential f32 sum over k of x[r,k]·w[j,k]).
// Each product of two bf16 values is exact in f32, so fmaf(a, b, acc) == acc + a·b rounded once,
// the CPU's mul-then-add. The k loop runs in index order for every output.
extern "C" __global__ void __launch_bounds__(256) gemm_exact(const bf16* __restrict__ X, const bf16* __restrict__ W, bf16* __restrict__ Y,
                                                            int M, int N, int K, long long ldx, long long ldw, long long ldy) {
    __shared__ float As[16][68];
    __shared__ float Bs[16][68];
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    int row0 = blockIdx.y * 64, col0 = blockIdx.x * 64;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 16) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int idx = threadIdx.x + i * 256;
            int r = idx >> 4, kk = idx & 15;
            int gk = k0 + kk;
            int gr = row0 + r, gc = col0 + r;
            As[kk][r] = (gr < M && gk < K) ? widen(X[(long long)gr * ldx + gk]) : 0.0f;
            Bs[kk][r] = (gc < N && gk < K) ? widen(W[(long long)gc * ldw + gk]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 16; kk++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = As[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = Bs[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int r = row0 + ty * 4 + i;
        if (r >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int c = col0 + tx * 4 + j;
            if (c < N) Y[(long long)r * ldy + c] = rnd(acc[i][j]);
        }
    }
}

// numerics::linear's quantized sums, exactly (MLX's CPU quantized_matmul): for every output
// column c whose rule is not 0, overwrite what gemm_exact wrote. rule 1 (affine): a bf16 running
// sum of bf16 products of x and the element; rule g > 1 (mxfp4/mxfp8/nvfp4, group g): per group
// such a sum, then sum = bf16(sum + bf16(scale * group_sum)). E holds each column's elements as
// the kernel forms them; scales[soff[c] + k/g] the column's group scales. Each product of two bf16
// values is exact in f32, so only the explicit roundings happen, in index order.
extern "C" __global__ void __launch_bounds__(256) gemm_exact_quant(const bf16* __restrict__ X, const bf16* __restrict__ E, const int* __restrict__ rule,
                                                                  const float* __restrict__ scales, const long long* __restrict__ soff, bf16* __restrict__ Y,
                                                                  int M, int N, int K, long long ldx, long long ldy) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= N) return;
    int g = rule[c];
    if (g == 0) return;
    const bf16* e = E + (long long)c * K;
    // Rows in a grid-stride loop: a chunk may hold more rows than a grid's y extent.
    for (int r = blockIdx.y; r < M; r += gridDim.y) {
        const bf16* x = X + (long long)r * ldx;
        float sum = 0.0f;
        if (g == 1) {
            for (int k = 0; k < K; k++) sum = rndf(sum + rndf(widen(x[k]) * widen(e[k])));
        } else {
            const float* sc = scales + soff[c];
            for (int k0 = 0; k0 < K; k0 += g) {
                float gs = 0.0f;
                for (int k = k0; k < k0 + g; k++) gs = rndf(gs + rndf(widen(x[k]) * widen(e[k])));
                sum = rndf(sum + rndf(sc[k0 / g] * gs));
            }
        }
        Y[(long long)r * ldy + c] = rnd(sum);
    }
}

// One row per block: optional `mscale` multiply (MLA k_pe), optional rms_norm
// (numerics::rms_norm_rows), then Rope::apply on the trailing 2*rope_pairs features at position
// pos0 + row (the leading features get MLX's angle-0 rotation). rope_pairs == 0: no rotation.
extern "C" __global__ void __launch_bounds__(256) norm_rope(const bf16* __restrict__ src, long long src_stride, bf16* __restrict__ dst, long long dst_stride,
                                                           int dim, const bf16* __restrict__ weight, float eps, int do_norm, float mscale, int do_mscale,
                                                           const float* __restrict__ inv_freq, int rope_pairs, long long pos0) {
    __shared__ float v[1024];
    __shared__ float sq[1024];
    __shared__ float nrm;
    int row = blockIdx.x;
    const bf16* s = src + (long long)row * src_stride;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float f = widen(s[i]);
        if (do_mscale) f = rndf(f * mscale);
        v[i] = f;
        sq[i] = f * f;
    }
    __syncthreads();
    if (do_norm) {
        if (threadIdx.x == 0) {
            float ss = 0.0f;
            for (int i = 0; i < dim; i++) ss += sq[i];
            float mean = ss / (float)dim;
            nrm = 1.0f / sqrtf(mean + eps);
        }
        __syncthreads();
        float n = nrm;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float y = rndf(v[i] * n);
            v[i] = rndf(y * widen(weight[i]));
        }
        __syncthreads();
    }
    bf16* d = dst + (long long)row * dst_stride;
    if (rope_pairs == 0) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) d[i] = rnd(v[i]);
        return;
    }
    int pairs = dim / 2;
    int nope = pairs - rope_pairs;
    float pos = (float)(pos0 + row);
    for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
        float x1 = v[2 * j], x2 = v[2 * j + 1];
        if (j < nope) {
            d[2 * j] = rnd(x1 - x2 * 0.0f);
            d[2 * j + 1] = rnd(x1 * 0.0f + x2);
        } else {
            float theta = pos * inv_freq[j - nope];
            float sf, cf;
            mlx_sincos(theta, &sf, &cf);
            float c = rndf(cf), sn = rndf(sf);
            float a = rndf(x1 * c), b = rndf(x2 * sn), e = rndf(x1 * sn), f = rndf(x2 * c);
            d[2 * j] = rnd(a - b);
            d[2 * j + 1] = rnd(e + f);
        }
    }
}

// A raw compressor row (kv | gate, 2*od wide in the stash, or a column range of Y) of token t.
struct Rows {
    const bf16* y; long long ys; int ycol; long long start;   // token `start` is Y's row 0
    const bf16* stash; long long seq0; int sw;                // token `seq0` is the stash's row 0
};
__device__ __forceinline__ const bf16* row_of(const Rows& r, long long t) {
    return t >= r.start ? r.y + (t - r.start) * r.ys + r.ycol : r.stash + (t - r.seq0) * r.sw;
}

// Compressor::overlap_pool (ratio 4) for W windows starting at token base0, one thread per
// (window, column). Output raw pooled rows [W, hd] (normalised and rotated afterwards).
extern "C" __global__ void pool_overlap(const bf16* y, long long ys, int ycol, long long start, const bf16* stash, long long seq0,
                                        long long base0, int W, int hd, const float* __restrict__ ape, int step, int bf16_sum, bf16* out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int w = blockIdx.y;
    if (c >= hd || w >= W) return;
    const int r = 4;
    int od = 2 * hd;
    Rows R = {y, ys, ycol, start, stash, seq0, 2 * od};
    long long base = base0 + (long long)w * r;
    bool prev = base > 0 && ((base - 1) / step) == ((base + r - 1) / step);
    float vals[8], kvs[8];
#pragma unroll
    for (int k = 0; k < r; k++) {
        if (prev) {
            const bf16* p = row_of(R, base - r + k);
            vals[k] = rndf(widen(p[od + c]) + rndf(ape[k * od + c]));
            kvs[k] = widen(p[c]);
        } else {
            vals[k] = __int_as_float(0xff800000);
            kvs[k] = 0.0f;
        }
        const bf16* q = row_of(R, base + k);
        vals[r + k] = rndf(widen(q[od + hd + c]) + rndf(ape[k * od + hd + c]));
        kvs[r + k] = widen(q[hd + c]);
    }
    float m = __int_as_float(0xff800000);
#pragma unroll
    for (int k = 0; k < 2 * r; k++) m = fmaxf(m, vals[k]);
    float e[8], norm = 0.0f;
#pragma unroll
    for (int k = 0; k < 2 * r; k++) { e[k] = mlx_exp(vals[k] - m); norm += e[k]; }
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < 2 * r; k++) acc = pool_add(bf16_sum, acc, rndf(kvs[k] * rndf(e[k] / norm)));
    out[(long long)w * hd + c] = rnd(acc);
}

// Compressor::simple_pool (any other ratio up to 128; od == hd). Block (32 columns, 8 lanes) per
// (window, column tile): the loads, exponentials and products run in parallel; the max, the
// softmax sum and the pooled sum run sequentially over k per column, in the CPU's order.
extern "C" __global__ void __launch_bounds__(256) pool_simple(const bf16* y, long long ys, int ycol, long long start, const bf16* stash, long long seq0,
                                                             long long base0, int W, int hd, int r, const float* __restrict__ ape, int bf16_sum, bf16* out) {
    __shared__ float sv[128][33];
    __shared__ float sk[128][33];
    __shared__ float sm[32], sn[32];
    int cx = threadIdx.x, ky = threadIdx.y;
    int c = blockIdx.x * 32 + cx;
    int w = blockIdx.y;
    bool ok = c < hd;
    int od = hd;
    Rows R = {y, ys, ycol, start, stash, seq0, 2 * od};
    long long base = base0 + (long long)w * r;
    for (int k = ky; k < r; k += 8) {
        const bf16* q = row_of(R, base + k);
        sv[k][cx] = ok ? widen(q[od + c]) + ape[k * od + c] : 0.0f;
        sk[k][cx] = ok ? widen(q[c]) : 0.0f;
    }
    __syncthreads();
    if (ky == 0) {
        float m = __int_as_float(0xff800000);
        for (int k = 0; k < r; k++) m = fmaxf(m, sv[k][cx]);
        sm[cx] = m;
    }
    __syncthreads();
    float m = sm[cx];
    for (int k = ky; k < r; k += 8) sv[k][cx] = mlx_exp(sv[k][cx] - m);
    __syncthreads();
    if (ky == 0) {
        float norm = 0.0f;
        for (int k = 0; k < r; k++) norm += sv[k][cx];
        sn[cx] = norm;
    }
    __syncthreads();
    float norm = sn[cx];
    for (int k = ky; k < r; k += 8) sk[k][cx] = rndf(sk[k][cx] * rndf(sv[k][cx] / norm));
    __syncthreads();
    if (ky == 0 && ok) {
        float acc = 0.0f;
        for (int k = 0; k < r; k++) acc = pool_add(bf16_sum, acc, sk[k][cx]);
        out[(long long)w * hd + c] = rnd(acc);
    }
}

// Copy raw compressor rows of tokens [t0, t0+count) (from Y or the old stash) into a new stash.
extern "C" __global__ void gather_rows(const bf16* y, long long ys, int ycol, long long start, const bf16* stash, long long seq0, int sw,
                                       long long t0, int count, bf16* dst) {
    int i = blockIdx.x;
    if (i >= count) return;
    Rows R = {y, ys, ycol, start, stash, seq0, sw};
    const bf16* s = row_of(R, t0 + i);
    for (int c = threadIdx.x; c < sw; c += blockDim.x) dst[(long long)i * sw + c] = s[c];
}

// A capture's block gather: copy each listed run of rows (rows × width values, rows src_stride
// values apart) packed to its offset in the block's device staging body. One launch per feed and
// block (blockIdx.y: the run), so the body leaves the device in one copy, not one per array.
struct RowCopy { unsigned long long src; long long src_stride; long long dst; int rows; int width; };
struct RowCopies { RowCopy c[16]; int n; };
extern "C" __global__ void __launch_bounds__(256) copy_rows(RowCopies b, bf16* __restrict__ dst) {
    if ((int)blockIdx.y >= b.n) return;
    const RowCopy c = b.c[blockIdx.y];
    const bf16* src = (const bf16*)c.src;
    long long total = (long long)c.rows * c.width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / c.width;
        dst[c.dst + i] = src[r * c.src_stride + (i - r * c.width)];
    }
}
