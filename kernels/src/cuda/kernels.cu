// Device kernels of the CUDA backend (compiled at run time with NVRTC, once per context).
// Every kernel is the device twin of a CPU function in `kernels/src` and must produce the same
// bytes: integer work is copied index for index, and float arithmetic uses explicitly rounded
// intrinsics (__fmul_rn, __fadd_rn, __fdiv_rn) so that no contraction or fast math can change a
// bit. Compiled with --fmad=false --ftz=false --prec-div=true.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define GRID_STRIDE(i, n) for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)blockDim.x * gridDim.x)

// ---- permutation.rs: gather_runs -------------------------------------------------------------
// dst[row][f] = src[row][perm[f]] over runs of `run` elements (bytes, or 16-byte words); rows of
// n_runs * run. The index arithmetic runs in 32 bits where every index fits (a 64-bit division
// is a long software sequence on the GPU, and these kernels do two per element).
template <typename T, typename I>
__device__ __forceinline__ void gather_body(const T* src, T* dst, const u32* perm, I total, I n_runs, I run) {
    I row_len = n_runs * run;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)blockDim.x * gridDim.x) {
        I row = i / row_len, rem = i % row_len;
        I f = rem / run, b = rem % run;
        dst[i] = src[row * row_len + (I)perm[f] * run + b];
    }
}

template <typename T>
__device__ __forceinline__ void gather(const T* src, T* dst, const u32* perm, u64 total, u64 n_runs, u64 run) {
    // The largest index formed is below total + the grid's stride; 2^31 leaves room for both.
    if (total < (1ull << 31)) gather_body<T, u32>(src, dst, perm, (u32)total, (u32)n_runs, (u32)run);
    else gather_body<T, u64>(src, dst, perm, total, n_runs, run);
}

extern "C" __global__ void gather_runs(const u8* src, u8* dst, const u32* perm, u64 total, u64 n_runs, u64 run_bytes) {
    gather(src, dst, perm, total, n_runs, run_bytes);
}

// The same on 16-byte words (run_bytes a multiple of 16; buffers are 256-byte aligned).
// Sizes count words.
extern "C" __global__ void gather_runs_v16(const uint4* src, uint4* dst, const u32* perm, u64 total, u64 n_runs, u64 run_words) {
    gather(src, dst, perm, total, n_runs, run_words);
}

// ---- backend.rs: expand_block_scales --------------------------------------------------------
extern "C" __global__ void expand_block_scales(const u8* src, u8* dst, u64 rows, u64 c, u64 bm, u64 block_cols, u64 per_block) {
    GRID_STRIDE(i, rows * c) {
        u64 r = i / c, j = i % c;
        dst[i] = src[(r / bm) * block_cols + j / per_block];
    }
}

// ---- e4m3.rs / e8m0.rs / mxfp8.rs -----------------------------------------------------------
__device__ __forceinline__ int binary_exponent(u32 bits) {
    int biased = (int)(bits >> 23);
    if (biased != 0) return biased - 127;
    u32 mant = bits & 0x7FFFFFu;
    return (31 - __clz(mant)) - 149;
}

__device__ __forceinline__ bool is_power_of_two(u32 bits) {
    if ((bits >> 23) != 0) return (bits & 0x7FFFFFu) == 0;
    u32 m = bits & 0x7FFFFFu;
    return m != 0 && (m & (m - 1)) == 0;
}

// rule 0 = rceil, 1 = floor. amax finite and > 0.
__device__ __forceinline__ int scale_exponent(float amax, int rule) {
    int e;
    if (rule == 0) {
        float s = __fdiv_rn(amax, 448.0f);
        u32 sb = __float_as_uint(s);
        if (sb == 0) e = -127;
        else e = binary_exponent(sb) + (is_power_of_two(sb) ? 0 : 1);
    } else {
        e = binary_exponent(__float_as_uint(amax)) - 8;
    }
    return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// 2^e for e in [-149, 127], exactly.
__device__ __forceinline__ float pow2(int e) {
    return e >= -126 ? __uint_as_float((u32)(e + 127) << 23) : __uint_as_float(1u << (e + 149));
}

// Round a finite f32 to E4M3fn: nearest even, saturating to +-448 (e4m3::from_f32_saturating).
__device__ __forceinline__ u8 e4m3_from_f32(float x) {
    u32 bits = __float_as_uint(x);
    u8 sign = (u8)((bits >> 24) & 0x80u);
    u32 a = bits & 0x7FFFFFFFu;
    if (a >= 0x43E00000u) return sign | 0x7E;
    if (a < 0x3C800000u) {
        float q = rintf(__fmul_rn(__uint_as_float(a), 512.0f));
        return sign | (u8)q;
    }
    int exp = (int)(a >> 23) - 127;
    u32 mant = a & 0x7FFFFFu;
    u32 m3 = mant >> 20;
    u32 rest = mant & 0xFFFFFu;
    if (rest > 0x80000u || (rest == 0x80000u && (m3 & 1u) == 1u)) m3 += 1;
    u32 biased = (u32)(exp + 7);
    if (m3 == 8) { m3 = 0; biased += 1; }
    if (biased > 15 || (biased == 15 && m3 == 7)) return sign | 0x7E;
    return sign | (u8)(biased << 3) | (u8)m3;
}

__device__ __forceinline__ float e4m3_to_f32(u8 b) {
    u32 exp = (b >> 3) & 0xFu, man = b & 7u;
    float v;
    if ((b & 0x7F) == 0x7F) v = __uint_as_float(0x7FC00000u);
    else if (exp == 0) v = __fmul_rn((float)man, 1.0f / 512.0f);
    else v = __uint_as_float(((exp - 7 + 127) << 23) | (man << 20));
    return (b & 0x80) ? -v : v;
}

__device__ __forceinline__ float e8m0_to_f32(u8 b) {
    if (b == 0xFF) return __uint_as_float(0x7FC00000u);
    return pow2((int)b - 127);
}

// MXFP8-quantizes BF16 rows [rows, k] (little-endian) along K, one thread per 32-element
// destination block, writing straight into the layout `mode` names:
// 0 identity; 1 destination row r reads source row perm[r]; 2 destination block j of every row
// reads source block perm[j]. A NaN or infinity records in *err the smallest key
// src_row * k + destination column among the elements that hold one: the CPU walks source rows
// in checkpoint order and each row's blocks in destination order, and reports the first it
// meets, so the smallest key is that element.
extern "C" __global__ void quantize_bf16(const u16* src, u8* elements, u8* scales, u64 rows, u64 k, int rule, int mode,
                                         const u32* perm, u64* err) {
    u64 c = k / 32;
    GRID_STRIDE(blk, rows * c) {
        u64 row = blk / c, j = blk % c;
        u64 src_row = mode == 1 ? (u64)perm[row] : row;
        u64 src_j = mode == 2 ? (u64)perm[j] : j;
        // The block's 64 bytes in four 16-byte loads and its 32 output bytes in two 16-byte
        // stores (a block starts at a multiple of 64 source and 32 destination bytes; device
        // allocations are 256-byte aligned), not one load or store per element.
        const uint4* in = (const uint4*)(src + src_row * k + src_j * 32);
        u32 w[16];
        for (int q = 0; q < 4; ++q) {
            uint4 v = in[q];
            w[4 * q] = v.x; w[4 * q + 1] = v.y; w[4 * q + 2] = v.z; w[4 * q + 3] = v.w;
        }
        u16 amax = 0;
        int bad = -1;
        for (int i = 0; i < 32; ++i) {
            u16 h = (u16)(w[i / 2] >> (16 * (i % 2)));
            u16 m = h & 0x7FFF;
            if (m > amax) amax = m;
            if (bad < 0 && (h & 0x7F80) == 0x7F80) bad = i;
        }
        uint4* out = (uint4*)(elements + row * k + j * 32);
        u32 o[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        u8 scale = 0;
        if (bad >= 0) {
            atomicMin(err, src_row * k + j * 32 + (u64)bad);
        } else if (amax != 0) {
            int e = scale_exponent(__uint_as_float((u32)amax << 16), rule);
            float inv = pow2(-e);
            for (int i = 0; i < 32; ++i) {
                u32 h = (w[i / 2] >> (16 * (i % 2))) & 0xFFFFu;
                o[i / 4] |= (u32)e4m3_from_f32(__fmul_rn(__uint_as_float(h << 16), inv)) << (8 * (i % 4));
            }
            scale = (u8)(e + 127);
        }
        uint4 lo, hi;
        lo.x = o[0]; lo.y = o[1]; lo.z = o[2]; lo.w = o[3];
        hi.x = o[4]; hi.y = o[5]; hi.z = o[6]; hi.w = o[7];
        out[0] = lo;
        out[1] = hi;
        scales[blk] = scale;
    }
}

// ---- layout.rs ------------------------------------------------------------------------------
__device__ __forceinline__ u64 swizzle_offset(u64 i, u64 j, u64 c) {
    u64 c4 = (c + 3) / 4;
    return ((i / 128) * c4 + j / 4) * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4 + j % 4;
}

// One thread per swizzled byte (padding written as zero).
extern "C" __global__ void swizzle_128x4(const u8* src, u8* dst, u64 m, u64 c, u64 total) {
    u64 c4 = (c + 3) / 4;
    GRID_STRIDE(o, total) {
        u64 tile = o / 512, w = o % 512;
        u64 i = (tile / c4) * 128 + ((w % 16) / 4) * 32 + w / 16;
        u64 j = (tile % c4) * 4 + w % 4;
        dst[o] = (i < m && j < c) ? src[i * c + j] : 0;
    }
}

// Inverse; counts non-zero padding bytes in *bad_padding.
extern "C" __global__ void unswizzle_128x4(const u8* src, u8* dst, u64 m, u64 c, u64 total, unsigned int* bad_padding) {
    u64 c4 = (c + 3) / 4;
    GRID_STRIDE(o, total) {
        u64 tile = o / 512, w = o % 512;
        u64 i = (tile / c4) * 128 + ((w % 16) / 4) * 32 + w / 16;
        u64 j = (tile % c4) * 4 + w % 4;
        if (i < m && j < c) dst[i * c + j] = src[o];
        else if (src[o] != 0) atomicAdd(bad_padding, 1u);
    }
}

// DeepGEMM packed UE8M0, MN-major: word ((g*k4 + q)*rows + r) = bytes (g*rows + r)*c + 4q .. +4.
extern "C" __global__ void pack_ue8m0(const u32* src, u32* dst, u64 groups, u64 rows, u64 k4) {
    GRID_STRIDE(w, groups * k4 * rows) {
        u64 g = w / (k4 * rows), rem = w % (k4 * rows);
        u64 q = rem / rows, r = rem % rows;
        dst[w] = src[(g * rows + r) * k4 + q];
    }
}

extern "C" __global__ void unpack_ue8m0(const u32* src, u32* dst, u64 groups, u64 rows, u64 k4) {
    GRID_STRIDE(w, groups * k4 * rows) {
        u64 g = w / (k4 * rows), rem = w % (k4 * rows);
        u64 q = rem / rows, r = rem % rows;
        dst[(g * rows + r) * k4 + q] = src[w];
    }
}

// ---- gemm.rs: out[t, n] = sum_k a[t, k] * w[n, k] --------------------------------------------
// `a` is the exact f32 dequantization of the MXFP8 activations [T, K]; w is E4M3 [N, K] with
// scales in layout `mode`: 0 row-major [N, K/32]; 1 F8_128x4 swizzled; 2 DeepGEMM packed
// UE8M0 of group `group` with `rows_per_group` rows. Each output accumulates its products in
// f32 in increasing k, one product at a time, each rounded: exactly the CPU `gemm`. That order
// leaves one sequential chain per output, so the parallelism is N x T threads' worth at most:
// - one thread per weight row n and group of TT tokens (blockIdx.y); TT is 1, 2, 4 or 8
//   (mx_gemm_t1 .. mx_gemm_t8), chosen by the caller: more tokens per thread decode each weight
//   for more of them, fewer give more warps; a block is one warp of GEMM_ROWS rows;
// - K goes by stages of GEMM_U blocks (of 32), GEMM_STAGES of them in flight in shared memory:
//   each thread copies its row's weights and scales, the block the stage's activations, all with
//   asynchronous copies, so that a thread sums one stage while the next ones are on their way;
// - a block's weights are decoded once for all TT tokens, without a branch per weight; a block
//   that holds a NaN byte takes the plain decode instead;
// - the loops over a stage's blocks stay a loop: unrolled, the code of a stage grows with its
//   blocks, and an earlier kernel ran twice as long with 8 blocks per stage as with 4.
// On an H200 this took the dsv41-flash TP 4 shapes from 89-272 us a GEMM at T = 1 (a first
// rewrite: a thread per row reading its weights and the activations from global memory) to
// 21-65 us; the bench (`orchestrator-worker bench-cuda`) prints the current figures.
#define GEMM_ROWS 32
#define GEMM_U 4
#define GEMM_STAGES 4

// Asynchronous copies from global to shared memory (cp.async, sm_80 and later): the thread goes
// on while they run. copies_commit closes a group of them; copies_wait<N> waits until at most N
// of the thread's groups are still running, and a barrier after it shows every thread's copies
// to the whole block. (The host check defines these as plain copies, and so do GPUs before sm_80.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// Before sm_80: plain copies (the barrier after copies_wait orders them the same way).
__device__ __forceinline__ void copy16_async(void* shared, const void* global) { *(uint4*)shared = *(const uint4*)global; }
__device__ __forceinline__ void copy4_async(void* shared, const void* global) { *(u32*)shared = *(const u32*)global; }
__device__ __forceinline__ void copies_commit() {}
template <int N>
__device__ __forceinline__ void copies_wait() {}
#elif !defined(KERNELS_ON_HOST)
__device__ __forceinline__ void copy16_async(void* shared, const void* global) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((u32)__cvta_generic_to_shared(shared)), "l"(global) : "memory");
}
__device__ __forceinline__ void copy4_async(void* shared, const void* global) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"((u32)__cvta_generic_to_shared(shared)), "l"(global) : "memory");
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void copies_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

__device__ __forceinline__ u64 gemm_scale_index(u64 n, u64 kb, u64 c, int mode, u64 group, u64 rows_per_group) {
    if (mode == 0) return n * c + kb;
    if (mode == 1) return swizzle_offset(n, kb, c);
    return ((group * (c / 4) + kb / 4) * rows_per_group + n) * 4 + kb % 4;
}

// The top bit of each of the four E4M3 bytes of `word` that is a NaN (low seven bits all set).
__device__ __forceinline__ u32 e4m3_nan_bytes(u32 word) {
    return ((word & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
}

__device__ __forceinline__ float float4_lane(float4 v, int r) {
    return r == 0 ? v.x : r == 1 ? v.y : r == 2 ? v.z : v.w;
}

// Byte r of `word` (an E4M3 that is not a NaN) as the f32 2^-120 * its value: its seven low bits
// placed at f32 bit 20 (a normal E4M3 becomes a normal f32 with the exponent 120 lower, a
// subnormal one a subnormal f32). Times `scale` * 2^120 it is __fmul_rn(e4m3_to_f32(byte),
// scale) exactly, one rounding of the same product, when that factor is finite (a scale of at
// most 2^7); else the product by 2^120 (exact) comes first.
__device__ __forceinline__ float e4m3_scaled_down(u32 word, int r) {
    u32 x = word << (24 - 8 * r);
    return __uint_as_float((x & 0x80000000u) | ((x >> 4) & 0x07F00000u));
}

// Adds one block of 32 weights times the TT tokens' activations to the sums, in increasing k.
// Each weight is its f32 value times the scale (weight(v), from e4m3_scaled_down), each product
// and sum rounded.
template <int TT, typename Weight>
__device__ __forceinline__ void gemm_block(float (&acc)[TT], const u32 (&words)[8], const float4 (*act)[GEMM_U * 8], int u, Weight weight) {
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        float4 av[TT];
#pragma unroll
        for (int j = 0; j < TT; ++j) av[j] = act[j][u * 8 + q];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            float wv = weight(e4m3_scaled_down(words[q], r));
#pragma unroll
            for (int j = 0; j < TT; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(float4_lane(av[j], r), wv));
        }
    }
}

// One stage in shared memory: GEMM_U blocks of each row's weights (a row padded by 16 bytes, so
// that the 32 rows' 16-byte reads fall in different banks), their scale bytes (one word per row),
// and GEMM_U blocks of 32 activations per token.
// (A stage's scale bytes are one 4-byte word per row; a block has at most GEMM_ROWS threads.)
static_assert(GEMM_U == 4, "a stage's scales are one word per row");
template <int TT>
struct GemmStage {
    uint4 w[GEMM_ROWS][2 * GEMM_U + 1];
    u32 scales[GEMM_ROWS];
    float4 a[TT][GEMM_U * 8];
};

// Starts the copies of stage `kb0` (blocks kb0 .. kb0 + GEMM_U) into `st`: the thread's own row
// (`lane`, row n) and its share of the activations. The scale bytes of a stage are one aligned
// word in the swizzled and packed layouts (and row-major with a multiple of 4 blocks); other
// row-major shapes read them one by one.
template <int TT>
__device__ __forceinline__ void gemm_stage_async(GemmStage<TT>& st, u32 lane, bool row_here, const u8* w_row, const u8* scales, u64 n,
                                                 u64 c, int mode, u64 group, u64 rows_per_group, const float* a, u64 t0, u64 t_rows,
                                                 u64 k, u64 kb0) {
    if (row_here) {
        for (int u = 0; u < GEMM_U; ++u) {
            u64 kb = kb0 + u;
            if (kb < c) {
                copy16_async(&st.w[lane][2 * u], w_row + kb * 32);
                copy16_async(&st.w[lane][2 * u + 1], w_row + kb * 32 + 16);
            }
        }
        if (kb0 < c) {
            if (mode != 0 || c % 4 == 0) {
                copy4_async(&st.scales[lane], scales + gemm_scale_index(n, kb0, c, mode, group, rows_per_group));
            } else {
                u32 word = 0;
                for (int u = 0; u < GEMM_U && kb0 + u < c; ++u) word |= (u32)scales[n * c + kb0 + u] << (8 * u);
                st.scales[lane] = word;
            }
        }
    }
    for (u32 i = threadIdx.x; i < TT * GEMM_U * 8; i += blockDim.x) {
        u32 j = i / (GEMM_U * 8), q = i % (GEMM_U * 8);
        u64 kb = kb0 + q / 8;
        u64 t = t0 + j < t_rows ? t0 + j : t_rows - 1;
        if (kb < c) copy16_async(&st.a[j][q], a + t * k + kb * 32 + (q % 8) * 4);
    }
    copies_commit();
}

template <int TT>
__device__ __forceinline__ void mx_gemm_rows(const float* a, u64 t_rows, const u8* w, const u8* scales, u64 n_rows, u64 k, int mode,
                                             u64 group, u64 rows_per_group, float* out) {
    __shared__ GemmStage<TT> stages[GEMM_STAGES];
    u32 lane = threadIdx.x;
    u64 n = (u64)blockIdx.x * blockDim.x + lane;
    u64 t0 = (u64)blockIdx.y * TT;
    // A thread past the last row still copies activations and meets the barriers.
    bool row_here = n < n_rows;
    u64 c = k / 32;
    const u8* w_row = w + (row_here ? n : 0) * k;
    float acc[TT];
#pragma unroll
    for (int j = 0; j < TT; ++j) acc[j] = 0.0f;
    u64 n_stages = (c + GEMM_U - 1) / GEMM_U;
    for (int p = 0; p < GEMM_STAGES - 1; ++p)
        gemm_stage_async<TT>(stages[p], lane, row_here, w_row, scales, n, c, mode, group, rows_per_group, a, t0, t_rows, k, (u64)p * GEMM_U);
    for (u64 i = 0; i < n_stages; ++i) {
        // Stage i is in; every thread is done with stage i - 1, whose buffer takes stage
        // i + GEMM_STAGES - 1 (an empty group past the end keeps the count).
        copies_wait<GEMM_STAGES - 2>();
        __syncthreads();
        gemm_stage_async<TT>(stages[(i + GEMM_STAGES - 1) % GEMM_STAGES], lane, row_here, w_row, scales, n, c, mode, group,
                             rows_per_group, a, t0, t_rows, k, (i + GEMM_STAGES - 1) * GEMM_U);
        const GemmStage<TT>& st = stages[i % GEMM_STAGES];
        if (!row_here) continue;
        u32 scale_word = st.scales[lane];
#pragma unroll 1
        for (int u = 0; u < GEMM_U; ++u) {
            u64 kb = i * GEMM_U + u;
            if (kb >= c) break;
            uint4 lo = st.w[lane][2 * u], hi = st.w[lane][2 * u + 1];
            u32 words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            u8 sb = (u8)(scale_word >> (8 * u));
            float s = e8m0_to_f32(sb);
            u32 nan = 0;
#pragma unroll
            for (int q = 0; q < 8; ++q) nan |= e4m3_nan_bytes(words[q]);
            if (nan != 0) {
#pragma unroll 1
                for (int e = 0; e < 32; ++e) {
                    float wv = __fmul_rn(e4m3_to_f32(((const u8*)&st.w[lane][2 * u])[e]), s);
                    const float* ae = (const float*)&st.a[0][u * 8] + e;
#pragma unroll
                    for (int j = 0; j < TT; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(ae[j * GEMM_U * 32], wv));
                }
            } else if (sb <= 134) {
                // One product per weight (a branch per block: one per weight kept the compiler
                // from overlapping one weight's work with the next).
                float s_2p120 = pow2((int)sb - 7);
                gemm_block<TT>(acc, words, st.a, u, [=](float v) { return __fmul_rn(v, s_2p120); });
            } else {
                gemm_block<TT>(acc, words, st.a, u, [=](float v) { return __fmul_rn(__fmul_rn(v, __uint_as_float(0x7B800000u)), s); });
            }
        }
    }
    if (row_here) {
#pragma unroll
        for (int j = 0; j < TT; ++j) {
            if (t0 + j < t_rows) out[(t0 + j) * n_rows + n] = acc[j];
        }
    }
}

#define MX_GEMM(TT)                                                                                                              \
    extern "C" __global__ void mx_gemm_t##TT(const float* a, u64 t_rows, const u8* w, const u8* scales, u64 n_rows, u64 k, int mode, \
                                             u64 group, u64 rows_per_group, float* out) {                                        \
        mx_gemm_rows<TT>(a, t_rows, w, scales, n_rows, k, mode, group, rows_per_group, out);                                    \
    }
MX_GEMM(1)
MX_GEMM(2)
MX_GEMM(4)
MX_GEMM(8)
