// SPDX-License-Identifier: Apache-2.0
// Gather/scatter of KV-cache pieces in one kernel launch: piece p copies len[p] bytes from
// src[p] to dst[p] (any device-visible addresses: GPU memory, or page-locked host memory
// mapped into the GPU's address space). One thread block per piece at a time, grid-stride
// over the pieces, 16-byte loads and stores when a piece allows them.
//
// mooncake_te does not compile this at install time (nothing CUDA is needed to build or
// import the package): scripts/gen_kvcopy_ptx.sh turns it into mooncake_te/cuda/kvcopy.ptx,
// which is committed and JIT-compiled by the driver (cuModuleLoadData) on first use.
extern "C" __global__ void mte_copy_pieces(const unsigned long long* __restrict__ src,
                                           const unsigned long long* __restrict__ dst,
                                           const unsigned long long* __restrict__ len,
                                           unsigned long long n)
{
    for (unsigned long long p = blockIdx.x; p < n; p += gridDim.x) {
        const unsigned long long s = src[p], d = dst[p], l = len[p];
        if (((s | d | l) & 15ULL) == 0) {
            const uint4* s4 = reinterpret_cast<const uint4*>(s);
            uint4* d4 = reinterpret_cast<uint4*>(d);
            const unsigned long long n4 = l >> 4;
            for (unsigned long long i = threadIdx.x; i < n4; i += blockDim.x)
                d4[i] = s4[i];
        } else {
            const unsigned char* s1 = reinterpret_cast<const unsigned char*>(s);
            unsigned char* d1 = reinterpret_cast<unsigned char*>(d);
            for (unsigned long long i = threadIdx.x; i < l; i += blockDim.x)
                d1[i] = s1[i];
        }
    }
}
