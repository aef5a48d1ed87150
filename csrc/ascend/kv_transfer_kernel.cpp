/*
 * Ascend C transfer between paged KV planes and one contiguous chunk buffer (both in device memory).
 *
 * Same contract as lmcache_platforms/kernels/contract.py: every (plane, row) pair with slot >= 0 moves
 * row_bytes between the plane (row = `segments` pieces of `segment_bytes`, `segment_stride` apart, so NHD,
 * HND and 310P FRACTAL_NZ rows are all one shape) and the plane-major buffer; slot < 0 leaves both sides
 * untouched. Work items are dealt round-robin over the vector cores; each moves its row through UB tiles,
 * many short segments per copy instruction (strided on the plane side, packed on the buffer side).
 *
 * Built by csrc/ascend/build.py with CANN's ascendc toolchain. LMCP_ALIGNED_COPY (310P builds) uses the
 * 32-byte-granular DataCopy, so the host side only sends geometries whose sizes and gaps are 32-byte
 * multiples; other chips use DataCopyPad, which copies any byte length.
 */
#include "kernel_operator.h"
#include "../lmcp_plane_table.h"

namespace {

constexpr int32_t kDepth = 2;   // double buffering: copy-in of the next tile overlaps copy-out of this one
constexpr uint32_t kTileBytes = 64 * 1024;
constexpr int64_t kUnit = 32;   // UB block size in bytes
constexpr int64_t kMaxPieces = 4095;
#if LMCP_ALIGNED_COPY
constexpr int64_t kMaxGap = 65535 * kUnit;  // DataCopyParams strides are uint16 counts of 32-byte blocks
#else
constexpr int64_t kMaxGap = 0xFFFFFFFFLL;   // DataCopyExtParams strides are uint32 byte counts
#endif

__aicore__ inline int64_t MinOf(int64_t a, int64_t b) { return a < b ? a : b; }
__aicore__ inline int64_t RoundUp(int64_t n) { return (n + kUnit - 1) / kUnit * kUnit; }

class PieceMover {
public:
    __aicore__ inline void Init() { pipe_.InitBuffer(queue_, kDepth, kTileBytes); }

    // Moves `count` pieces of `bytes` each: piece i goes from src + i * src_pitch to dst + i * dst_pitch.
    __aicore__ inline void Move(__gm__ uint8_t *src, int64_t src_pitch, __gm__ uint8_t *dst, int64_t dst_pitch,
                                int64_t count, int64_t bytes)
    {
        if (bytes > kTileBytes) {
            for (int64_t i = 0; i < count; ++i) {
                for (int64_t off = 0; off < bytes; off += kTileBytes) {
                    Copy(src + i * src_pitch + off, 0, dst + i * dst_pitch + off, 0, 1,
                         MinOf(kTileBytes, bytes - off));
                }
            }
            return;
        }
        const bool gaps_fit = src_pitch - bytes <= kMaxGap && dst_pitch - bytes <= kMaxGap;
        const int64_t per_copy = gaps_fit ? MinOf(kMaxPieces, kTileBytes / RoundUp(bytes)) : 1;
        for (int64_t done = 0; done < count; done += per_copy) {
            const int64_t n = MinOf(per_copy, count - done);
            Copy(src + done * src_pitch, n > 1 ? src_pitch - bytes : 0, dst + done * dst_pitch,
                 n > 1 ? dst_pitch - bytes : 0, n, bytes);
        }
    }

private:
    __aicore__ inline void Copy(__gm__ uint8_t *src, int64_t src_gap, __gm__ uint8_t *dst, int64_t dst_gap,
                                int64_t pieces, int64_t bytes)
    {
        AscendC::GlobalTensor<uint8_t> from;
        AscendC::GlobalTensor<uint8_t> to;
        from.SetGlobalBuffer(src);
        to.SetGlobalBuffer(dst);
        AscendC::LocalTensor<uint8_t> tile = queue_.AllocTensor<uint8_t>();
#if LMCP_ALIGNED_COPY
        AscendC::DataCopyParams in{static_cast<uint16_t>(pieces), static_cast<uint16_t>(bytes / kUnit),
                                   static_cast<uint16_t>(src_gap / kUnit), 0};
        AscendC::DataCopy(tile, from, in);
#else
        AscendC::DataCopyExtParams in{static_cast<uint16_t>(pieces), static_cast<uint32_t>(bytes),
                                      static_cast<uint32_t>(src_gap), 0, 0};
        AscendC::DataCopyPad(tile, from, in, AscendC::DataCopyPadExtParams<uint8_t>{false, 0, 0, 0});
#endif
        queue_.EnQue(tile);
        tile = queue_.DeQue<uint8_t>();
#if LMCP_ALIGNED_COPY
        AscendC::DataCopyParams out{static_cast<uint16_t>(pieces), static_cast<uint16_t>(bytes / kUnit), 0,
                                    static_cast<uint16_t>(dst_gap / kUnit)};
        AscendC::DataCopy(to, tile, out);
#else
        AscendC::DataCopyExtParams out{static_cast<uint16_t>(pieces), static_cast<uint32_t>(bytes), 0,
                                       static_cast<uint32_t>(dst_gap), 0};
        AscendC::DataCopyPad(to, tile, out);
#endif
        queue_.FreeTensor(tile);
    }

    AscendC::TPipe pipe_;
    AscendC::TQueBind<AscendC::TPosition::VECIN, AscendC::TPosition::VECOUT, kDepth> queue_;
};

}  // namespace

extern "C" __global__ __aicore__ void lmcp_kv_transfer(GM_ADDR table, GM_ADDR slots, GM_ADDR buffer,
                                                        int64_t num_planes, int64_t num_rows,
                                                        int64_t slots_plane_stride, int64_t store)
{
#if !LMCP_ALIGNED_COPY
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
#endif
    AscendC::GlobalTensor<int64_t> fields;
    AscendC::GlobalTensor<int64_t> slot_of;
    fields.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(table));
    slot_of.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(slots));
    PieceMover mover;
    mover.Init();
    const int64_t items = num_planes * num_rows;
    for (int64_t item = AscendC::GetBlockIdx(); item < items; item += AscendC::GetBlockNum()) {
        const int64_t plane = item / num_rows;
        const int64_t row = item - plane * num_rows;
        const int64_t slot = slot_of.GetValue(plane * slots_plane_stride + row);
        if (slot < 0) {
            continue;
        }
        const int64_t f = plane * LMCP_PLANE_FIELDS;
        const int64_t base = fields.GetValue(f + LMCP_F_BASE);
        const int64_t block_stride = fields.GetValue(f + LMCP_F_BLOCK_STRIDE);
        const int64_t rows_per_block = fields.GetValue(f + LMCP_F_ROWS_PER_BLOCK);
        const int64_t row_stride = fields.GetValue(f + LMCP_F_ROW_STRIDE);
        int64_t segments = fields.GetValue(f + LMCP_F_SEGMENTS);
        int64_t segment_bytes = fields.GetValue(f + LMCP_F_SEGMENT_BYTES);
        int64_t segment_stride = fields.GetValue(f + LMCP_F_SEGMENT_STRIDE);
        const int64_t row_bytes = fields.GetValue(f + LMCP_F_ROW_BYTES);
        const int64_t buffer_prefix = fields.GetValue(f + LMCP_F_BUFFER_PREFIX);
        if (segment_stride == segment_bytes) {  // dense row: one piece
            segments = 1;
            segment_bytes = row_bytes;
            segment_stride = row_bytes;
        }
        const int64_t block = slot / rows_per_block;
        const int64_t in_block = slot - block * rows_per_block;
        __gm__ uint8_t *plane_row =
            reinterpret_cast<__gm__ uint8_t *>(base + block * block_stride + in_block * row_stride);
        __gm__ uint8_t *buffer_row =
            reinterpret_cast<__gm__ uint8_t *>(buffer) + buffer_prefix * num_rows + row * row_bytes;
        if (store) {
            mover.Move(plane_row, segment_stride, buffer_row, segment_bytes, segments, segment_bytes);
        } else {
            mover.Move(buffer_row, segment_bytes, plane_row, segment_stride, segments, segment_bytes);
        }
    }
}

extern "C" void lmcp_kv_transfer_launch(uint32_t block_dim, void *stream, void *table, void *slots, void *buffer,
                                        int64_t num_planes, int64_t num_rows, int64_t slots_plane_stride,
                                        int64_t store)
{
    lmcp_kv_transfer<<<block_dim, nullptr, stream>>>(
        reinterpret_cast<GM_ADDR>(table), reinterpret_cast<GM_ADDR>(slots), reinterpret_cast<GM_ADDR>(buffer),
        num_planes, num_rows, slots_plane_stride, store);
}
