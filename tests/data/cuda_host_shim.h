// Host shims: run the CUDA C kernels on the CPU, one (block, thread) at a time.
#include <cstring>
#include <cstdint>
struct dim3_ { unsigned x, y, z; };
static dim3_ blockIdx, threadIdx, gridDim, blockDim;
struct uint4 { unsigned x, y, z, w; };
#define __global__
#define __device__
#define __forceinline__ inline
static inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
