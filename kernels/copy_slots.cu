// copy_slots: one launch copies every (pair, buffer) slot row of a batch.
//
// A buffer is one array whose axis 0 is the slot index; buffer b's row for slot s starts
// at base[b] + s * stride[b] (bytes) and is row_bytes[b] long. For every pair i and every
// buffer b this kernel copies the row of slot src_idx[i] in the source buffer to the row
// of slot dst_idx[i] in the destination buffer. Addresses are device pointers; host
// buffers are mapped pinned memory, whose host pointer is valid on the device under UVA.
//
// Work decomposition (launch sizes are chosen, and explained, in
// python/radixcache/_kernels.py):
//   * a row is r = pair * n_buf + buf; blockIdx.x strides over rows;
//   * a row is split into chunks of chunk_bytes (a multiple of 16); blockIdx.y strides
//     over the chunks of its row, so a large row (an SSM state) spreads over many blocks
//     while a small row (one token's K or V in one layer) is one chunk for one block;
//   * threads of a block stride over the chunk, 16 bytes (int4) at a time when the source
//     row, the destination row and the row length are all 16-byte aligned, else 4 bytes
//     when all are 4-byte aligned, else 1 byte.
// Both grid dimensions are grid-stride loops, so any grid size copies everything.
// The alignment test is per row, hence uniform across the block (no divergence).
//
// Source and destination rows must not overlap (as for memcpy). Indices and strides are
// trusted: the caller validates them (a wrong one is an out-of-bounds access).

// Independent 16-byte loads each thread issues before its stores: several loads in flight
// per thread hide the latency of HBM and, more so, of mapped host memory over PCIe/C2C.
enum : int { kUnroll = 4 };

// Copies len bytes, 16 at a time; d, s and len are multiples of 16.
__device__ __forceinline__ void copy_16(char* d, const char* s, long long len) {
    const int4* s4 = reinterpret_cast<const int4*>(s);
    int4* d4 = reinterpret_cast<int4*>(d);
    const long long n = len >> 4;
    const long long step = static_cast<long long>(blockDim.x) * kUnroll;
    for (long long base = threadIdx.x; base < n; base += step) {
        int4 v[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const long long i = base + static_cast<long long>(k) * blockDim.x;
            if (i < n) {
                v[k] = s4[i];
            }
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const long long i = base + static_cast<long long>(k) * blockDim.x;
            if (i < n) {
                d4[i] = v[k];
            }
        }
    }
}

// Copies len bytes, 4 at a time; d, s and len are multiples of 4.
__device__ __forceinline__ void copy_4(char* d, const char* s, long long len) {
    const unsigned int* s4 = reinterpret_cast<const unsigned int*>(s);
    unsigned int* d4 = reinterpret_cast<unsigned int*>(d);
    const long long n = len >> 2;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        d4[i] = s4[i];
    }
}

// Copies len bytes one at a time (any alignment).
__device__ __forceinline__ void copy_1(char* d, const char* s, long long len) {
    for (long long i = threadIdx.x; i < len; i += blockDim.x) {
        d[i] = s[i];
    }
}

extern "C" __global__ void copy_slots(
    const unsigned long long* src_base,   // [n_buf] byte addresses
    const unsigned long long* dst_base,   // [n_buf]
    const long long* src_stride,          // [n_buf] bytes between consecutive source slots
    const long long* dst_stride,          // [n_buf]
    const long long* row_bytes,           // [n_buf] bytes to copy per slot
    int n_buf,
    const long long* src_idx,             // [n_pairs] source slot per pair
    const long long* dst_idx,             // [n_pairs] destination slot per pair
    int n_pairs,
    long long chunk_bytes)                // bytes per chunk, a positive multiple of 16
{
    if (n_buf <= 0 || n_pairs <= 0 || chunk_bytes <= 0 || (chunk_bytes & 15) != 0) {
        return;
    }
    const long long n_rows = static_cast<long long>(n_pairs) * n_buf;
    for (long long r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const long long pair = r / n_buf;
        const int buf = static_cast<int>(r - pair * n_buf);
        const long long nbytes = row_bytes[buf];
        if (nbytes <= 0) {
            continue;
        }
        const long long n_chunks = (nbytes + chunk_bytes - 1) / chunk_bytes;
        if (static_cast<long long>(blockIdx.y) >= n_chunks) {
            continue;  // a small row: fewer chunks than grid rows in y
        }
        // Signed products, then two's-complement addition: exact for any in-bounds row.
        const unsigned long long src_row =
            src_base[buf] + static_cast<unsigned long long>(src_idx[pair] * src_stride[buf]);
        const unsigned long long dst_row =
            dst_base[buf] + static_cast<unsigned long long>(dst_idx[pair] * dst_stride[buf]);
        const unsigned long long len_bits = static_cast<unsigned long long>(nbytes);
        // chunk_bytes is a multiple of 16, so chunk starts keep the row's alignment and
        // every chunk end is either a chunk start or the row end.
        const bool aligned16 = ((src_row | dst_row | len_bits) & 15ULL) == 0;
        const bool aligned4 = ((src_row | dst_row | len_bits) & 3ULL) == 0;
        for (long long c = blockIdx.y; c < n_chunks; c += gridDim.y) {
            const long long begin = c * chunk_bytes;
            const long long left = nbytes - begin;
            const long long len = left < chunk_bytes ? left : chunk_bytes;
            const char* s = reinterpret_cast<const char*>(src_row) + begin;
            char* d = reinterpret_cast<char*>(dst_row) + begin;
            if (aligned16) {
                copy_16(d, s, len);
            } else if (aligned4) {
                copy_4(d, s, len);
            } else {
                copy_1(d, s, len);
            }
        }
    }
}
