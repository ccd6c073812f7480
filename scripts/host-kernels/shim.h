// CUDA built-ins for compiling kernels.cu as host C++ (scripts/check_kernels_on_host.sh): one
// thread per block, blocks run one after another, so __syncthreads is a no-op and __shared__
// memory is a static. Floating point is IEEE single precision with round-to-nearest-even (SSE;
// compiled with -ffp-contract=off), like the explicitly rounded intrinsics on the GPU.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

struct HostDim3 { unsigned x = 0, y = 0, z = 0; };
static HostDim3 blockIdx, threadIdx, blockDim, gridDim;
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() ((void)0)
#define KERNELS_ON_HOST 1
// cp.async: the GPU faults on a source or destination not aligned to the copy's size.
inline void copy_aligned(void* shared, const void* global, size_t n) {
    if ((size_t)shared % n || (size_t)global % n) {
        std::fprintf(stderr, "cp.async of %zu bytes from a misaligned address\n", n);
        std::abort();
    }
    std::memcpy(shared, global, n);
}
inline void copy16_async(void* shared, const void* global) { copy_aligned(shared, global, 16); }
inline void copy4_async(void* shared, const void* global) { copy_aligned(shared, global, 4); }
inline void copies_commit() {}
template <int N> inline void copies_wait() {}

inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) { unsigned long long o = *p; if (v < o) *p = v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p += v; return o; }
