// CUDA kernels of the Lynx KV codec: the GPU twins of the NumPy reference in
// lynx_decode/codec_pack.py and codec_quant.py (same format, bit for bit).
// Compiled at run time by CuPy (NVRTC, no headers) and checked by check_nvcc.sh.
//
// Packing: 64 values form a block of 8 little-endian uint64 words (one value per
// byte lane); a block of w-bit fields is w words, where lane k of the 8 words
// forms S_k = sum_i v[i][k] << (i*w) and byte k of packed word m is byte m of S_k.
// fp32 arithmetic uses explicit _rn intrinsics so nothing is contracted into FMA.

typedef unsigned long long u64;
typedef unsigned char u8;

#define LYNX_REP 0x0101010101010101ULL

// word m of the packed block of lane values ((x[i] >> shift) & mask)
__device__ __forceinline__ u64 lynx_pack_word(const u64 *x, int shift, u64 mask, int w, int m) {
    u64 acc = 0ULL;
    for (int i = 0; i < 8; ++i) {
        const int s = i * w - 8 * m;
        if (s > -w && s < 8) {
            const u64 v = (x[i] >> shift) & mask;
            if (s >= 0) {
                acc |= (v << s) & (((0xFFULL << s) & 0xFFULL) * LYNX_REP);
            } else {
                acc |= (v >> (-s)) & (((1ULL << (w + s)) - 1ULL) * LYNX_REP);
            }
        }
    }
    return acc;
}

// word i (8 lane values) of the packed block p[0 .. w-1]
__device__ __forceinline__ u64 lynx_unpack_word(const u64 *p, int w, int i) {
    u64 acc = 0ULL;
    for (int m = 0; m < w; ++m) {
        const int s = i * w - 8 * m;
        if (s > -w && s < 8) {
            if (s >= 0) {
                const int keep = (w < 8 - s) ? w : 8 - s;
                acc |= (p[m] >> s) & (((1ULL << keep) - 1ULL) * LYNX_REP);
            } else {
                acc |= (p[m] << (-s)) & ((((1ULL << (w + s)) - 1ULL) << (-s)) * LYNX_REP);
            }
        }
    }
    return acc;
}

__device__ __forceinline__ long long lynx_index() {
    return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// codes[8*nblk] -> anchor[wa*nblk] (top wa bits) and residual[(8-wa)*nblk]
extern "C" __global__ void lynx_split(const u64 *codes, u64 *anchor, u64 *residual, long long nblk, int wa) {
    const long long blk = lynx_index();
    if (blk >= nblk) return;
    const int wr = 8 - wa;
    const u64 amask = ((1ULL << wa) - 1ULL) * LYNX_REP;
    const u64 rmask = ((1ULL << wr) - 1ULL) * LYNX_REP;
    u64 x[8];
    for (int i = 0; i < 8; ++i) x[i] = codes[blk * 8 + i];
    for (int m = 0; m < wa; ++m) anchor[blk * wa + m] = lynx_pack_word(x, wr, amask, wa, m);
    for (int m = 0; m < wr; ++m) residual[blk * wr + m] = lynx_pack_word(x, 0, rmask, wr, m);
}

// inverse of lynx_split: exactly the 8-bit codes
extern "C" __global__ void lynx_merge(const u64 *anchor, const u64 *residual, u64 *codes, long long nblk, int wa) {
    const long long blk = lynx_index();
    if (blk >= nblk) return;
    const int wr = 8 - wa;
    u64 a[8];
    u64 r[8];
    for (int m = 0; m < wa; ++m) a[m] = anchor[blk * wa + m];
    for (int m = 0; m < wr; ++m) r[m] = residual[blk * wr + m];
    for (int i = 0; i < 8; ++i) {
        codes[blk * 8 + i] = (lynx_unpack_word(a, wa, i) << wr) | lynx_unpack_word(r, wr, i);
    }
}

// values[8*nblk] (lane values < 2**w) -> packed[w*nblk]
extern "C" __global__ void lynx_pack(const u64 *values, u64 *packed, long long nblk, int w) {
    const long long blk = lynx_index();
    if (blk >= nblk) return;
    const u64 mask = ((1ULL << w) - 1ULL) * LYNX_REP;
    u64 x[8];
    for (int i = 0; i < 8; ++i) x[i] = values[blk * 8 + i];
    for (int m = 0; m < w; ++m) packed[blk * w + m] = lynx_pack_word(x, 0, mask, w, m);
}

// packed[w*nblk] -> values[8*nblk], one value per byte
extern "C" __global__ void lynx_unpack(const u64 *packed, u64 *values, long long nblk, int w) {
    const long long blk = lynx_index();
    if (blk >= nblk) return;
    u64 p[8];
    for (int m = 0; m < w; ++m) p[m] = packed[blk * w + m];
    for (int i = 0; i < 8; ++i) values[blk * 8 + i] = lynx_unpack_word(p, w, i);
}

// index of the scale/zero of element (h, t, d): K (kind 0) per channel over token
// groups [H, ceil(T/g), D]; V (kind 1) per token over channel groups [H, T, ceil(D/g)]
__device__ __forceinline__ long long lynx_param_index(long long i, int tokens, int dim, int group, int kind) {
    const long long d = i % dim;
    const long long ht = i / dim;
    const long long t = ht % tokens;
    const long long h = ht / tokens;
    if (kind == 0) {
        const long long groups = (tokens + group - 1) / group;
        return (h * groups + t / group) * dim + d;
    }
    const long long groups = (dim + group - 1) / group;
    return ht * groups + d / group;
}

// out = clip(rint((x - zero) * inv), 0, levels)
extern "C" __global__ void lynx_quantize(const float *x, const float *inv, const float *zero, u8 *out, int heads,
                                         int tokens, int dim, int group, int kind, float levels, long long n) {
    const long long i = lynx_index();
    if (i >= n || heads <= 0) return;
    const long long p = lynx_param_index(i, tokens, dim, group, kind);
    float y = rintf(__fmul_rn(__fsub_rn(x[i], zero[p]), inv[p]));
    y = fminf(fmaxf(y, 0.0f), levels);
    out[i] = static_cast<u8>(y);
}

// out = (values * mult + offset) * scale + zero, one rounding per operation
extern "C" __global__ void lynx_dequant(const u8 *values, float mult, float offset, const float *scale,
                                        const float *zero, float *out, int heads, int tokens, int dim, int group,
                                        int kind, long long n) {
    const long long i = lynx_index();
    if (i >= n || heads <= 0) return;
    const long long p = lynx_param_index(i, tokens, dim, group, kind);
    const float code = __fadd_rn(__fmul_rn(static_cast<float>(values[i]), mult), offset);
    out[i] = __fadd_rn(__fmul_rn(code, scale[p]), zero[p]);
}
