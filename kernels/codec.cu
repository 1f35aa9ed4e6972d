// CUDA kernels of the Lynx KV codec: the GPU twins of the NumPy reference in
// lynx_decode/codec/pack.py and codec/quant.py (same format, bit for bit).
// Compiled at run time by CuPy (NVRTC, no headers) and checked by check_nvcc.sh.
//
// Packing: 64 values form a block of 8 little-endian uint64 words (one value per
// byte lane); a block of w-bit fields is w words, where lane k of the 8 words
// forms S_k = sum_i v[i][k] << (i*w) and byte k of packed word m is byte m of S_k.
// fp32 arithmetic uses explicit _rn intrinsics so nothing is contracted into FMA.
//
// The per-block and per-element bodies are __host__ __device__ so that the test
// suite can also run them on the CPU (tests/unit/test_kernels_cuda_host.py).

typedef unsigned long long u64;
typedef unsigned char u8;

#define LYNX_REP 0x0101010101010101ULL

#ifdef __CUDA_ARCH__
#define LYNX_SUB(a, b) __fsub_rn((a), (b))
#define LYNX_MUL(a, b) __fmul_rn((a), (b))
#define LYNX_ADD(a, b) __fadd_rn((a), (b))
#define LYNX_DIV(a, b) __fdiv_rn((a), (b))
#else
#define LYNX_SUB(a, b) ((a) - (b))
#define LYNX_MUL(a, b) ((a) * (b))
#define LYNX_ADD(a, b) ((a) + (b))
#define LYNX_DIV(a, b) ((a) / (b))
#endif

// word m of the packed block of lane values ((x[i] >> shift) & mask)
__host__ __device__ __forceinline__ u64 lynx_pack_word(const u64 *x, int shift, u64 mask, int w, int m) {
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
__host__ __device__ __forceinline__ u64 lynx_unpack_word(const u64 *p, int w, int i) {
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

// one block: codes[0..7] -> anchor[0..wa-1] (top wa bits), residual[0..7-wa]
__host__ __device__ __forceinline__ void lynx_split_block(const u64 *codes, u64 *anchor, u64 *residual, int wa) {
    const int wr = 8 - wa;
    const u64 amask = ((1ULL << wa) - 1ULL) * LYNX_REP;
    const u64 rmask = ((1ULL << wr) - 1ULL) * LYNX_REP;
    u64 x[8];
    for (int i = 0; i < 8; ++i) x[i] = codes[i];
    for (int m = 0; m < wa; ++m) anchor[m] = lynx_pack_word(x, wr, amask, wa, m);
    for (int m = 0; m < wr; ++m) residual[m] = lynx_pack_word(x, 0, rmask, wr, m);
}

// one block: inverse of lynx_split_block
__host__ __device__ __forceinline__ void lynx_merge_block(const u64 *anchor, const u64 *residual, u64 *codes, int wa) {
    const int wr = 8 - wa;
    u64 a[8];
    u64 r[8];
    for (int m = 0; m < wa; ++m) a[m] = anchor[m];
    for (int m = 0; m < wr; ++m) r[m] = residual[m];
    for (int i = 0; i < 8; ++i) codes[i] = (lynx_unpack_word(a, wa, i) << wr) | lynx_unpack_word(r, wr, i);
}

// one block: values[0..7] (lane values < 2**w) -> packed[0..w-1]
__host__ __device__ __forceinline__ void lynx_pack_block(const u64 *values, u64 *packed, int w) {
    const u64 mask = ((1ULL << w) - 1ULL) * LYNX_REP;
    u64 x[8];
    for (int i = 0; i < 8; ++i) x[i] = values[i];
    for (int m = 0; m < w; ++m) packed[m] = lynx_pack_word(x, 0, mask, w, m);
}

// one block: packed[0..w-1] -> values[0..7]
__host__ __device__ __forceinline__ void lynx_unpack_block(const u64 *packed, u64 *values, int w) {
    u64 p[8];
    for (int m = 0; m < w; ++m) p[m] = packed[m];
    for (int i = 0; i < 8; ++i) values[i] = lynx_unpack_word(p, w, i);
}

// index of the scale/zero of flat element i = (h, t, d): K (kind 0) per channel over
// token groups [H, ceil(T/g), D]; V (kind 1) per token over channel groups [H, T, ceil(D/g)]
__host__ __device__ __forceinline__ long long lynx_param_index(long long i, int tokens, int dim, int group, int kind) {
    const long long d = i % dim;
    const long long ht = i / dim;
    if (kind == 0) {
        const long long t = ht % tokens;
        const long long h = ht / tokens;
        const long long groups = (tokens + group - 1) / group;
        return (h * groups + t / group) * dim + d;
    }
    const long long groups = (dim + group - 1) / group;
    return ht * groups + d / group;
}

// clip(rint((x - zero) * inv), 0, levels)
__host__ __device__ __forceinline__ u8 lynx_quantize_one(float x, float inv, float zero, float levels) {
    float y = rintf(LYNX_MUL(LYNX_SUB(x, zero), inv));
    y = fminf(fmaxf(y, 0.0f), levels);
    return static_cast<u8>(y);
}

// (value * mult + offset) * scale + zero, one rounding per operation
__host__ __device__ __forceinline__ float lynx_dequant_one(u8 value, float mult, float offset, float scale, float zero) {
    const float code = LYNX_ADD(LYNX_MUL(static_cast<float>(value), mult), offset);
    return LYNX_ADD(LYNX_MUL(code, scale), zero);
}

// occ-mean: the code at which an end bin holding n members of its group is rebuilt, as a
// distance from the group's edge, r missing bits: float((n-1) * (2^r - 1)) / float(2n),
// both integers exact in fp32, one correctly rounded division (n == 0: 0, never read)
__host__ __device__ __forceinline__ float lynx_end_inset(int n, int rbits) {
    const int m = n > 1 ? n : 1;
    return LYNX_DIV(static_cast<float>((m - 1) * ((1 << rbits) - 1)), static_cast<float>(2 * m));
}

// the code of prefix value v (= q >> shift): lo / hi in the end bins (0 and top), else v * mult + offset
__host__ __device__ __forceinline__ float lynx_end_code(u8 v, float mult, float offset, u8 top, float lo, float hi) {
    if (v == 0) return lo;
    if (v == top) return hi;
    return LYNX_ADD(LYNX_MUL(static_cast<float>(v), mult), offset);
}

// The kernels' bodies, one call per thread index (also run on the host by the tests).
__host__ __device__ __forceinline__ void lynx_split_at(long long blk, const u64 *codes, u64 *anchor, u64 *residual,
                                                       long long nblk, int wa) {
    if (blk < nblk) lynx_split_block(codes + blk * 8, anchor + blk * wa, residual + blk * (8 - wa), wa);
}

__host__ __device__ __forceinline__ void lynx_merge_at(long long blk, const u64 *anchor, const u64 *residual, u64 *codes,
                                                       long long nblk, int wa) {
    if (blk < nblk) lynx_merge_block(anchor + blk * wa, residual + blk * (8 - wa), codes + blk * 8, wa);
}

__host__ __device__ __forceinline__ void lynx_pack_at(long long blk, const u64 *values, u64 *packed, long long nblk, int w) {
    if (blk < nblk) lynx_pack_block(values + blk * 8, packed + blk * w, w);
}

__host__ __device__ __forceinline__ void lynx_unpack_at(long long blk, const u64 *packed, u64 *values, long long nblk,
                                                        int w) {
    if (blk < nblk) lynx_unpack_block(packed + blk * w, values + blk * 8, w);
}

__host__ __device__ __forceinline__ void lynx_quantize_at(long long i, const float *x, const float *inv, const float *zero,
                                                          u8 *out, int heads, int tokens, int dim, int group, int kind,
                                                          float levels, long long n) {
    if (i >= n || heads <= 0) return;
    const long long p = lynx_param_index(i, tokens, dim, group, kind);
    out[i] = lynx_quantize_one(x[i], inv[p], zero[p], levels);
}

__host__ __device__ __forceinline__ void lynx_dequant_at(long long i, const u8 *values, float mult, float offset,
                                                         const float *scale, const float *zero, float *out, int heads,
                                                         int tokens, int dim, int group, int kind, long long n) {
    if (i >= n || heads <= 0) return;
    const long long p = lynx_param_index(i, tokens, dim, group, kind);
    out[i] = lynx_dequant_one(values[i], mult, offset, scale[p], zero[p]);
}

// one quantization group g (flat index into the group-shaped params): count its members whose
// prefix value is 0 / top and write their occ-mean codes lo[g] = inset(n_lo), hi[g] = 255 - inset(n_hi).
// K (kind 0): channel d over tokens [t0, t0 + group); V (kind 1): token over channels [d0, d0 + group)
__host__ __device__ __forceinline__ void lynx_end_codes_at(long long g, const u8 *values, float *lo, float *hi,
                                                           int heads, int tokens, int dim, int group, int kind,
                                                           int shift, long long ngroups) {
    if (g >= ngroups || heads <= 0) return;
    const u8 top = static_cast<u8>(255 >> shift);
    long long first;
    long long stride;
    int count;
    if (kind == 0) {
        const long long groups = (tokens + group - 1) / group;
        const long long d = g % dim;
        const long long hg = g / dim;
        const long long t0 = (hg % groups) * group;
        first = ((hg / groups) * tokens + t0) * dim + d;
        stride = dim;
        count = static_cast<int>((tokens - t0 < group) ? tokens - t0 : group);
    } else {
        const long long groups = (dim + group - 1) / group;
        const long long d0 = (g % groups) * group;
        first = (g / groups) * dim + d0;
        stride = 1;
        count = static_cast<int>((dim - d0 < group) ? dim - d0 : group);
    }
    int n_lo = 0;
    int n_hi = 0;
    for (int j = 0; j < count; ++j) {
        const u8 v = values[first + j * stride];
        n_lo += (v == 0);
        n_hi += (v == top);
    }
    lo[g] = lynx_end_inset(n_lo, shift);
    hi[g] = LYNX_SUB(255.0f, lynx_end_inset(n_hi, shift));
}

// as lynx_dequant_at, the end bins at their group's occ-mean codes lo / hi (group-shaped)
__host__ __device__ __forceinline__ void lynx_dequant_ends_at(long long i, const u8 *values, float mult, float offset,
                                                              int top, const float *lo, const float *hi,
                                                              const float *scale, const float *zero, float *out,
                                                              int heads, int tokens, int dim, int group, int kind,
                                                              long long n) {
    if (i >= n || heads <= 0) return;
    const long long p = lynx_param_index(i, tokens, dim, group, kind);
    const float code = lynx_end_code(values[i], mult, offset, static_cast<u8>(top), lo[p], hi[p]);
    out[i] = LYNX_ADD(LYNX_MUL(code, scale[p]), zero[p]);
}

__device__ __forceinline__ long long lynx_index() {
    return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// packing kernels: one thread per 64-value block; codes/values [8*nblk] words, packed [w*nblk]
extern "C" __global__ void lynx_split(const u64 *codes, u64 *anchor, u64 *residual, long long nblk, int wa) {
    lynx_split_at(lynx_index(), codes, anchor, residual, nblk, wa);
}

extern "C" __global__ void lynx_merge(const u64 *anchor, const u64 *residual, u64 *codes, long long nblk, int wa) {
    lynx_merge_at(lynx_index(), anchor, residual, codes, nblk, wa);
}

extern "C" __global__ void lynx_pack(const u64 *values, u64 *packed, long long nblk, int w) {
    lynx_pack_at(lynx_index(), values, packed, nblk, w);
}

extern "C" __global__ void lynx_unpack(const u64 *packed, u64 *values, long long nblk, int w) {
    lynx_unpack_at(lynx_index(), packed, values, nblk, w);
}

// element kernels: one thread per element of [H, T, D]
extern "C" __global__ void lynx_quantize(const float *x, const float *inv, const float *zero, u8 *out, int heads,
                                         int tokens, int dim, int group, int kind, float levels, long long n) {
    lynx_quantize_at(lynx_index(), x, inv, zero, out, heads, tokens, dim, group, kind, levels, n);
}

extern "C" __global__ void lynx_dequant(const u8 *values, float mult, float offset, const float *scale,
                                        const float *zero, float *out, int heads, int tokens, int dim, int group,
                                        int kind, long long n) {
    lynx_dequant_at(lynx_index(), values, mult, offset, scale, zero, out, heads, tokens, dim, group, kind, n);
}

// occ-mean (a prefix of a Split.MSB layer): one thread per quantization group, then one per element
extern "C" __global__ void lynx_end_codes(const u8 *values, float *lo, float *hi, int heads, int tokens, int dim,
                                          int group, int kind, int shift, long long ngroups) {
    lynx_end_codes_at(lynx_index(), values, lo, hi, heads, tokens, dim, group, kind, shift, ngroups);
}

extern "C" __global__ void lynx_dequant_ends(const u8 *values, float mult, float offset, int top, const float *lo,
                                             const float *hi, const float *scale, const float *zero, float *out,
                                             int heads, int tokens, int dim, int group, int kind, long long n) {
    lynx_dequant_ends_at(lynx_index(), values, mult, offset, top, lo, hi, scale, zero, out, heads, tokens, dim, group,
                         kind, n);
}
