/*
 * Native CPU transfer between paged KV planes and one contiguous chunk buffer.
 *
 * One call moves a whole transfer group in one direction: every (plane, row) pair is an independent work
 * item, split across OpenMP threads. Rows whose bytes follow the previous row's bytes in the plane (same
 * or physically adjacent block, payload without gaps) are merged into one memcpy by the item that starts
 * the run, so NHD layouts copy whole blocks at a time. Plain C ABI: loaded with ctypes, no Python headers.
 */
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* Must match lmcache_platforms/kernels/plane_table.py (nine int64 fields per plane). */
typedef struct {
    int64_t base;          /* address of block 0, row 0, segment 0 */
    int64_t block_stride;  /* bytes */
    int64_t rows_per_block;
    int64_t row_stride;    /* bytes */
    int64_t segments;
    int64_t segment_bytes;
    int64_t segment_stride; /* bytes */
    int64_t row_bytes;     /* segments * segment_bytes */
    int64_t buffer_prefix; /* row bytes of the planes before this one: its rows start at prefix * rows */
} lmcp_plane;

enum { LMCP_STORE = 0, LMCP_LOAD = 1 };

/* Below this many bytes a transfer runs on the calling thread: waking the team costs more than it saves. */
#define LMCP_PARALLEL_MIN_BYTES (256 * 1024)

static inline uint8_t *row_address(const lmcp_plane *p, int64_t slot) {
    int64_t block = slot / p->rows_per_block;
    int64_t row = slot - block * p->rows_per_block;
    return (uint8_t *)(intptr_t)(p->base + block * p->block_stride + row * p->row_stride);
}

static inline int payload_is_dense(const lmcp_plane *p) {
    return p->segments == 1 || p->segment_stride == p->segment_bytes;
}

/* True when row r's plane bytes directly follow row r-1's, so r belongs to the run that r-1 is in. */
static inline int continues_run(const lmcp_plane *p, const int64_t *slots, int64_t r) {
    if (r == 0 || slots[r - 1] < 0 || slots[r] < 0) return 0;
    return row_address(p, slots[r]) == row_address(p, slots[r - 1]) + p->row_bytes;
}

static void copy_segments(const lmcp_plane *p, uint8_t *plane_row, uint8_t *buf_row, int direction) {
    const int64_t n = p->segments, sb = p->segment_bytes, ss = p->segment_stride;
    if (direction == LMCP_STORE) {
        if (sb == 2) {
            for (int64_t s = 0; s < n; ++s) memcpy(buf_row + 2 * s, plane_row + s * ss, 2);
        } else if (sb == 4) {
            for (int64_t s = 0; s < n; ++s) memcpy(buf_row + 4 * s, plane_row + s * ss, 4);
        } else {
            for (int64_t s = 0; s < n; ++s) memcpy(buf_row + s * sb, plane_row + s * ss, (size_t)sb);
        }
    } else {
        if (sb == 2) {
            for (int64_t s = 0; s < n; ++s) memcpy(plane_row + s * ss, buf_row + 2 * s, 2);
        } else if (sb == 4) {
            for (int64_t s = 0; s < n; ++s) memcpy(plane_row + s * ss, buf_row + 4 * s, 4);
        } else {
            for (int64_t s = 0; s < n; ++s) memcpy(plane_row + s * ss, buf_row + s * sb, (size_t)sb);
        }
    }
}

static void move_item(const lmcp_plane *p, const int64_t *slots, int64_t num_rows, int64_t r, uint8_t *buffer,
                      int direction) {
    int64_t slot = slots[r];
    if (slot < 0) return;
    uint8_t *plane_row = row_address(p, slot);
    uint8_t *buf_row = buffer + p->buffer_prefix * num_rows + r * p->row_bytes;
    if (!payload_is_dense(p)) {
        copy_segments(p, plane_row, buf_row, direction);
        return;
    }
    if (continues_run(p, slots, r)) return; /* the item that starts this run copies it */
    int64_t end = r + 1;
    while (end < num_rows && continues_run(p, slots, end)) ++end;
    size_t bytes = (size_t)((end - r) * p->row_bytes);
    if (direction == LMCP_STORE) {
        memcpy(buf_row, plane_row, bytes);
    } else {
        memcpy(plane_row, buf_row, bytes);
    }
}

/*
 * Moves rows between `num_planes` planes and `buffer`. `slots` holds `num_rows` int64 per plane, plane p's
 * list starting at `slots + p * slots_plane_stride` (stride 0: one list shared by every plane); slots < 0
 * are skipped. Inputs are validated by the caller. Returns 0, or -1 for an unknown direction.
 */
int lmcp_transfer(const lmcp_plane *planes, int64_t num_planes, const int64_t *slots, int64_t slots_plane_stride,
                  int64_t num_rows, uint8_t *buffer, int direction, int num_threads) {
    if (direction != LMCP_STORE && direction != LMCP_LOAD) return -1;
    const int64_t items = num_planes * num_rows;
    int64_t total_bytes = 0;
    for (int64_t p = 0; p < num_planes; ++p) total_bytes += planes[p].row_bytes * num_rows;
    int threads = num_threads > 0 ? num_threads : 1;
    if (total_bytes < LMCP_PARALLEL_MIN_BYTES) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < items; ++i) {
        const int64_t p = i / num_rows, r = i - p * num_rows;
        move_item(&planes[p], slots + p * slots_plane_stride, num_rows, r, buffer, direction);
    }
    return 0;
}

/* Lets the loader check it got a library built from this source (bump when lmcp_plane changes). */
int lmcp_abi_version(void) { return 1; }
