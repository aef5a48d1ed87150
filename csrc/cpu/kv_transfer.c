/*
 * Native CPU transfer between paged KV planes and one contiguous chunk buffer.
 *
 * One call moves a whole transfer group in one direction: every (plane, row) pair is an independent work
 * item. Consecutive slots whose payloads are adjacent in the plane (same block, or the next block when
 * blocks are unpadded) form a run moved with one memcpy, so NHD layouts copy whole blocks at a time.
 * Plain C ABI: loaded with ctypes, no Python headers.
 *
 * Parallelism: a small pthread pool where the calling thread starts at once and helpers join when they get
 * a CPU, taking items from a shared counter; the caller waits only for helpers that joined. An OpenMP
 * region instead waits for every team thread at its end, which cost ~3 ms per call on a busy 2-core
 * machine (one region per chunk and transfer group adds up); the pool degrades to one thread there.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* lmcp_plane and LMCP_ABI_VERSION, generated from lmcache_platforms/kernels/plane_table.py. */
#include "../lmcp_plane_table.h"
#include "crc32c.h"

enum { LMCP_STORE = 0, LMCP_LOAD = 1 };

/* Below this many bytes a transfer runs on the calling thread: waking helpers costs more than it saves. */
#define LMCP_PARALLEL_MIN_BYTES (256 * 1024)

static inline uint8_t *row_address(const lmcp_plane *p, int64_t slot) {
    int64_t block = slot / p->rows_per_block;
    int64_t row = slot - block * p->rows_per_block;
    return (uint8_t *)(intptr_t)(p->base + block * p->block_stride + row * p->row_stride);
}

static inline int payload_is_dense(const lmcp_plane *p) {
    return p->segments == 1 || p->segment_stride == p->segment_bytes;
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

/*
 * A store reads rows scattered over the planes, and a short run (a block of 16 rows of 132 bytes) ends
 * before the hardware prefetcher gets going: while copying, keep the ~8 KiB of rows that follow the current
 * run requested, so the next runs are already in flight. Each row is requested once.
 */
#define LMCP_PREFETCH_BYTES 8192

static inline int64_t prefetch_rows(const lmcp_plane *p, const int64_t *slots, int64_t num_rows, int64_t from,
                                    int64_t until) {
    if (until > num_rows) until = num_rows;
    for (int64_t r = from; r < until; ++r) {
        if (slots[r] < 0) continue;
        const uint8_t *row = row_address(p, slots[r]);
        for (int64_t b = 0; b < p->row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
    }
    return from > until ? from : until;
}

/*
 * Long runs (block pages) are written with non-temporal stores: a page copied with plain stores first reads
 * the destination's cache lines in, and a store or load of many pages never reads them back soon. Measured
 * single-thread on pages from random blocks of a 768 MiB cache (GB/s, plain memcpy vs streaming): a store
 * (random reads, sequential writes) 8.0 vs 7.5 at 16 KiB, 9.6 vs 10.6 at 32 KiB, 11 vs 13 at 64 KiB; a load
 * (sequential reads, random writes) 7.8 vs 12.4 at 8 KiB, 11 vs 16 at 64 KiB. Each thread fences its
 * streaming stores before it reports its items done (run_items).
 */
#define LMCP_STREAM_STORE_BYTES 32768
#define LMCP_STREAM_LOAD_BYTES 8192

#if defined(__SSE2__)
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t bytes) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > bytes) head = bytes; /* a piece cut at a stripe boundary may be shorter than the alignment */
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= bytes; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, bytes - i);
}
static inline void stream_fence(void) { _mm_sfence(); }
#else
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t bytes) { memcpy(dst, src, bytes); }
static inline void stream_fence(void) {}
#endif

static inline void copy_run(uint8_t *plane_bytes, uint8_t *buf_bytes, size_t bytes, int direction) {
    uint8_t *dst = direction == LMCP_STORE ? buf_bytes : plane_bytes;
    const uint8_t *src = direction == LMCP_STORE ? plane_bytes : buf_bytes;
    if (bytes >= (direction == LMCP_STORE ? LMCP_STREAM_STORE_BYTES : LMCP_STREAM_LOAD_BYTES)) {
        stream_copy(dst, src, bytes);
    } else {
        memcpy(dst, src, bytes);
    }
}

/*
 * A transfer that hashes the buffer bytes it moves (a store: lmcp_transfer_crc; a load: lmcp_transfer_load_crc)
 * follows the buffer bytes one thread moves in order with a cursor: the raw CRC state of the piece of the
 * current stripe, cut into a new piece at each stripe boundary. Bytes a run copies are hashed inside the copy
 * (lmcp_crc_copy_fold), whichever side the buffer is on; bytes moved another way (transposed tiles, strided
 * segments) or not moved (skipped rows) are hashed from the buffer right after, while they are in cache.
 */
typedef struct {
    int64_t stripe;   /* stripe bytes */
    int64_t pos;      /* object offset of the next byte */
    int64_t boundary; /* object offset where the current stripe ends */
    int64_t start;    /* object offset of the current piece's first byte */
    uint32_t crc;     /* raw state of the current piece */
    struct lmcp_piece *out; /* the next piece slot of this grab */
    int64_t stream_from;    /* copies of at least this many bytes bypass the cache (copy_run's threshold) */
} lmcp_cursor;

typedef struct lmcp_piece {
    int64_t offset;
    int64_t len;
    uint32_t crc;
} lmcp_piece;

static void cursor_emit(lmcp_cursor *c) {
    if (c->pos > c->start) *c->out++ = (lmcp_piece){c->start, c->pos - c->start, c->crc};
    c->start = c->pos;
    c->crc = 0;
}

/*
 * The cursor's next n buffer bytes: with `src`, copied from there to dst as copy_run would and hashed as they
 * pass (with the fold, inside the copy loop; else from the source, in cache right after each piece), the
 * buffer being dst (a store) or src (a load); with src NULL, the buffer's bytes at dst (moved another way, or
 * a skipped row's), hashed there.
 */
static void cursor_take(lmcp_cursor *c, uint8_t *dst, const uint8_t *src, int64_t n) {
    const int stream = n >= c->stream_from, fold = src != NULL && lmcp_crc_folds();
    while (n > 0) {
        const int64_t m = n < c->boundary - c->pos ? n : c->boundary - c->pos;
        if (src == NULL) {
            c->crc = lmcp_crc_raw(c->crc, dst, (size_t)m);
        } else if (fold) {
            c->crc = lmcp_crc_copy_fold(dst, src, (size_t)m, c->crc, stream);
        } else {
            if (stream) {
                stream_copy(dst, src, (size_t)m);
            } else {
                memcpy(dst, src, (size_t)m);
            }
            c->crc = lmcp_crc_raw(c->crc, src, (size_t)m);
        }
        dst += m, c->pos += m, n -= m;
        if (src != NULL) src += m;
        if (c->pos == c->boundary) {
            cursor_emit(c);
            c->boundary += c->stripe;
        }
    }
}

/*
 * K stored transposed (vLLM's CPU `vec` cache): a row's segments are single elements a whole block of rows
 * apart, and inside each segment the rows of a block sit side by side. Row by row, every element is its own
 * strided access (~1 GB/s where a plain copy does ~10); so a run of consecutive rows of one block is moved in
 * tiles of LMCP_TILE rows x LMCP_TILE segments, each read as LMCP_TILE contiguous pieces on one side and
 * written as LMCP_TILE contiguous pieces on the other. Rows and segments left over go element by element.
 */
#define LMCP_TILE 8

static inline int rows_interleaved(const lmcp_plane *p) {
    return p->segments >= LMCP_TILE && p->row_stride == p->segment_bytes &&
           (p->segment_bytes == 2 || p->segment_bytes == 4);
}

/* The segments after the last whole tile, for rows [r0, r0 + LMCP_TILE) of a run: element by element. */
static void move_tail_segments(const lmcp_plane *p, uint8_t *plane_run, uint8_t *buf_run, int64_t r0, int64_t from,
                               int64_t item, int direction) {
    for (int64_t r = r0; r < r0 + LMCP_TILE; ++r) {
        for (int64_t s = from; s < p->segments; ++s) {
            uint8_t *in_plane = plane_run + s * p->segment_stride + r * item, *in_buf = buf_run + r * p->row_bytes + s * item;
            if (direction == LMCP_STORE) {
                memcpy(in_buf, in_plane, (size_t)item);
            } else {
                memcpy(in_plane, in_buf, (size_t)item);
            }
        }
    }
}

#define LMCP_TILES(NAME, T)                                                                                    \
    static void NAME(const lmcp_plane *p, uint8_t *plane_run, uint8_t *buf_run, int64_t rows, int direction) { \
        const int64_t ss = p->segment_stride, rb = p->row_bytes, whole = p->segments / LMCP_TILE * LMCP_TILE; \
        for (int64_t r0 = 0; r0 < rows; r0 += LMCP_TILE) {                                                    \
            for (int64_t s0 = 0; s0 < whole; s0 += LMCP_TILE) {                                               \
                T tile[LMCP_TILE][LMCP_TILE];                                                                 \
                if (direction == LMCP_STORE) {                                                                \
                    for (int s = 0; s < LMCP_TILE; ++s)                                                       \
                        memcpy(tile[s], plane_run + (s0 + s) * ss + r0 * sizeof(T), sizeof tile[s]);          \
                    for (int r = 0; r < LMCP_TILE; ++r) {                                                     \
                        T row[LMCP_TILE];                                                                     \
                        for (int s = 0; s < LMCP_TILE; ++s) row[s] = tile[s][r];                              \
                        memcpy(buf_run + (r0 + r) * rb + s0 * sizeof(T), row, sizeof row);                    \
                    }                                                                                         \
                } else {                                                                                      \
                    for (int r = 0; r < LMCP_TILE; ++r)                                                       \
                        memcpy(tile[r], buf_run + (r0 + r) * rb + s0 * sizeof(T), sizeof tile[r]);           \
                    for (int s = 0; s < LMCP_TILE; ++s) {                                                     \
                        T piece[LMCP_TILE];                                                                   \
                        for (int r = 0; r < LMCP_TILE; ++r) piece[r] = tile[r][s];                            \
                        memcpy(plane_run + (s0 + s) * ss + r0 * sizeof(T), piece, sizeof piece);              \
                    }                                                                                         \
                }                                                                                             \
            }                                                                                                 \
            move_tail_segments(p, plane_run, buf_run, r0, whole, sizeof(T), direction);                       \
        }                                                                                                     \
    }
LMCP_TILES(move_tiles_4, uint32_t)

#if defined(__SSE2__)

/* The 8 x 8 transpose of 2-byte elements in registers: three rounds of interleaving 2-, 4- and 8-byte pairs. */
static inline void transpose_8x8_16(__m128i v[8]) {
    __m128i a[8], b[8];
    for (int i = 0; i < 4; ++i) {
        a[2 * i] = _mm_unpacklo_epi16(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi16(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        b[4 * i] = _mm_unpacklo_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm_unpackhi_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm_unpacklo_epi32(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm_unpackhi_epi32(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = _mm_unpacklo_epi64(b[i], b[i + 4]);
        v[2 * i + 1] = _mm_unpackhi_epi64(b[i], b[i + 4]);
    }
}

/* move_tiles for 2-byte elements with the tile transposed in SSE2 registers (every x86-64 CPU has them). */
static void move_tiles_2(const lmcp_plane *p, uint8_t *plane_run, uint8_t *buf_run, int64_t rows, int direction) {
    const int64_t ss = p->segment_stride, rb = p->row_bytes, whole = p->segments / LMCP_TILE * LMCP_TILE;
    for (int64_t r0 = 0; r0 < rows; r0 += LMCP_TILE) {
        for (int64_t s0 = 0; s0 < whole; s0 += LMCP_TILE) {
            __m128i v[LMCP_TILE];
            if (direction == LMCP_STORE) {
                for (int s = 0; s < LMCP_TILE; ++s)
                    v[s] = _mm_loadu_si128((const __m128i *)(plane_run + (s0 + s) * ss + r0 * 2));
                transpose_8x8_16(v);
                for (int r = 0; r < LMCP_TILE; ++r) _mm_storeu_si128((__m128i *)(buf_run + (r0 + r) * rb + s0 * 2), v[r]);
            } else {
                for (int r = 0; r < LMCP_TILE; ++r)
                    v[r] = _mm_loadu_si128((const __m128i *)(buf_run + (r0 + r) * rb + s0 * 2));
                transpose_8x8_16(v);
                for (int s = 0; s < LMCP_TILE; ++s) _mm_storeu_si128((__m128i *)(plane_run + (s0 + s) * ss + r0 * 2), v[s]);
            }
        }
        move_tail_segments(p, plane_run, buf_run, r0, whole, 2, direction);
    }
}
#else
LMCP_TILES(move_tiles_2, uint16_t)
#endif

/* Rows [first, last) of an interleaved plane: whole tiles of each run of one block's consecutive rows. */
static void move_interleaved(const lmcp_plane *p, const int64_t *slots, int64_t first, int64_t last,
                             uint8_t *plane_rows, int direction) {
    int64_t r = first;
    while (r < last) {
        const int64_t slot = slots[r];
        if (slot < 0) {
            ++r;
            continue;
        }
        const int64_t row = slot % p->rows_per_block;
        int64_t end = r + 1;
        while (end < last && slots[end] == slots[end - 1] + 1 && (row + end - r) < p->rows_per_block) ++end;
        const int64_t tiled = (end - r) / LMCP_TILE * LMCP_TILE;
        if (tiled) {
            uint8_t *run = row_address(p, slot);
            if (p->segment_bytes == 2) {
                move_tiles_2(p, run, plane_rows + r * p->row_bytes, tiled, direction);
            } else {
                move_tiles_4(p, run, plane_rows + r * p->row_bytes, tiled, direction);
            }
        }
        for (int64_t t = r + tiled; t < end; ++t)
            copy_segments(p, row_address(p, slots[t]), plane_rows + t * p->row_bytes, direction);
        r = end;
    }
}

/*
 * A load that checks what it writes (lmcp_transfer_checked): before any row is written, every stripe of the
 * object its buffer bytes lie in must match the CRC the object carries (lmcp_crc_check, each stripe hashed
 * once by whichever thread needs it first, then copied from cache). The first stripe that does not stops every
 * thread: only bytes of matching stripes reach the planes.
 *
 * A hash that runs before its copy leaves the copy idle while it reads, where a plain load streams reads and
 * writes at once. So each thread hashes ahead (lmcp_checker): it claims the stripes after those it checked,
 * those wholly inside its grab, one at a time, and hashes them inside the loops that copy its current rows
 * (lmcp_crc_copy_beside), as many bytes hashed as copied. When its rows reach a stripe claimed ahead, the
 * verdict is in or nearly. Measured on 2 threads of an AMD EPYC (AVX-512), over a plain load of the same
 * objects: llama8b +35 % hashing each stripe first, +17 % hashing ahead; deepseek-v4 +42 % and +30 %.
 */
typedef struct {
    const uint8_t *object; /* the object's first byte */
    int64_t payload;
    int64_t stripe;
    int64_t origin; /* object offset of buffer[0] */
    const uint32_t *expected;
    atomic_uint *state;
    atomic_int bad;
} lmcp_check;

/* One thread's view of a checked load: the grab it works on, and the stripe it hashes ahead of its copies. */
typedef struct {
    lmcp_check *shared;
    int64_t limit;    /* object offset where the grab's bytes end */
    int64_t frontier; /* start of the first stripe of the grab this thread has neither checked nor passed over */
    int64_t ahead;    /* the stripe this thread claimed (LMCP_STRIPE_BUSY) and hashes ahead, or -1 */
    int64_t done;     /* its bytes hashed so far */
    uint32_t crc;
} lmcp_checker;

/* Bytes of the stripe that begins at object offset `start`. */
static inline int64_t stripe_len(const lmcp_check *chk, int64_t start) {
    return chk->payload - start < chk->stripe ? chk->payload - start : chk->stripe;
}

/*
 * Claims the stripe at the frontier for hashing ahead: the first still new, lying wholly inside the grab (one
 * that crosses its end is another grab's too, and that thread would wait on this one's copies). 0 when none.
 */
static int claim_ahead(lmcp_checker *c) {
    const lmcp_check *chk = c->shared;
    while (c->ahead < 0 && c->frontier < chk->payload) {
        const int64_t end = c->frontier + stripe_len(chk, c->frontier), k = c->frontier / chk->stripe;
        if (end > c->limit) return 0;
        c->frontier = end;
        unsigned seen = LMCP_STRIPE_NEW;
        if (atomic_compare_exchange_strong_explicit(&chk->state[k], &seen, LMCP_STRIPE_BUSY, memory_order_acq_rel,
                                                    memory_order_acquire)) {
            c->ahead = k, c->done = 0, c->crc = 0xFFFFFFFFu;
        }
    }
    return c->ahead >= 0;
}

/* Counts `n` more bytes of the stripe claimed ahead as hashed (into c->crc); once all are in, its verdict. */
static void hashed_ahead(lmcp_checker *c, int64_t n) {
    const lmcp_check *chk = c->shared;
    c->done += n;
    if (c->done < stripe_len(chk, c->ahead * chk->stripe)) return;
    const unsigned verdict = ~c->crc == chk->expected[c->ahead] ? LMCP_STRIPE_GOOD : LMCP_STRIPE_BAD;
    atomic_store_explicit(&chk->state[c->ahead], verdict, memory_order_release);
    c->ahead = -1;
}

/* Bytes of the stripe claimed ahead still to hash, and where they start. */
static inline int64_t ahead_left(const lmcp_checker *c, const uint8_t **at) {
    const lmcp_check *chk = c->shared;
    const int64_t start = c->ahead * chk->stripe;
    *at = chk->object + start + c->done;
    return stripe_len(chk, start) - c->done;
}

/* Hashes up to `n` bytes ahead (all of the claimed stripe's rest with INT64_MAX and nothing claimed next). */
static void hash_ahead(lmcp_checker *c, int64_t n, int claim) {
    while (n > 0 && (claim ? claim_ahead(c) : c->ahead >= 0)) {
        const uint8_t *at;
        const int64_t left = ahead_left(c, &at), m = n < left ? n : left;
        c->crc = lmcp_crc_raw(c->crc, at, (size_t)m);
        hashed_ahead(c, m);
        n -= m;
    }
}

/* Whether buffer bytes [offset, offset + n) may be written out: their stripes match, and none failed so far. */
static int checked(lmcp_checker *c, int64_t offset, int64_t n) {
    lmcp_check *chk = c->shared;
    if (atomic_load_explicit(&chk->bad, memory_order_relaxed)) return 0;
    const int64_t from = chk->origin + offset, to = from + n, last = (to - 1) / chk->stripe;
    if (c->ahead >= 0 && c->ahead <= last) hash_ahead(c, INT64_MAX, 0);
    if (!lmcp_crc_check(chk->object, chk->payload, chk->stripe, chk->expected, chk->state, from, to)) {
        atomic_store_explicit(&chk->bad, 1, memory_order_relaxed);
        return 0;
    }
    if (c->frontier <= last * chk->stripe) c->frontier = (last + 1) * chk->stripe;
    return 1;
}

/* A run of a checked load, copied with the stripes ahead hashed inside the copy loop, byte for byte. */
static void copy_run_checked(lmcp_checker *c, uint8_t *plane_bytes, const uint8_t *buf_bytes, int64_t bytes) {
    while (bytes > 0 && claim_ahead(c)) {
        const uint8_t *at;
        const int64_t left = ahead_left(c, &at), n = bytes < left ? bytes : left;
        c->crc = lmcp_crc_copy_beside(plane_bytes, buf_bytes, (size_t)n, at, c->crc, n >= LMCP_STREAM_LOAD_BYTES);
        hashed_ahead(c, n);
        plane_bytes += n, buf_bytes += n, bytes -= n;
    }
    if (bytes > 0) copy_run(plane_bytes, (uint8_t *)buf_bytes, (size_t)bytes, LMCP_LOAD);
}

/*
 * A run of a checked load, `bytes` at buffer `offset` to `plane_bytes`, about a stripe at a time: each piece
 * (whole `row_bytes` rows, through the one that crosses the next stripe boundary: a row is written whole or
 * not at all) is checked, then copied while the stripes after it are hashed. 0 when a stripe did not match.
 */
static int move_run_checked(lmcp_checker *c, uint8_t *plane_bytes, int64_t offset, uint8_t *buffer, int64_t bytes,
                            int64_t row_bytes) {
    const int64_t stripe = c->shared->stripe, origin = c->shared->origin;
    while (bytes > 0) {
        const int64_t room = (origin + offset) / stripe * stripe + stripe - (origin + offset);
        const int64_t whole_rows = (room + row_bytes - 1) / row_bytes * row_bytes;
        const int64_t n = bytes < whole_rows ? bytes : whole_rows;
        if (!checked(c, offset, n)) return 0;
        copy_run_checked(c, plane_bytes, buffer + offset, n);
        plane_bytes += n, offset += n, bytes -= n;
    }
    return 1;
}

/* Rows [first, last) of a plane whose rows are not plain byte runs: transposed tiles or strided segments. */
static void move_strided(const lmcp_plane *p, const int64_t *slots, int64_t first, int64_t last, uint8_t *plane_rows,
                         int direction) {
    if (rows_interleaved(p)) {
        move_interleaved(p, slots, first, last, plane_rows, direction);
        return;
    }
    for (int64_t r = first; r < last; ++r) {
        if (slots[r] >= 0) copy_segments(p, row_address(p, slots[r]), plane_rows + r * p->row_bytes, direction);
    }
}

/* In a store that hashes, strided rows are moved about this many bytes at a time, then hashed from cache. */
#define LMCP_HASHED_SPAN_BYTES (16 * 1024)

/*
 * Moves rows [first, last) of one plane, one memcpy per run of adjacent rows (a run is cut at `last`, so a
 * long run is shared by the threads whose ranges it crosses). Within a run the next address is stepped,
 * not divided out, so a run costs one division. With a cursor (a transfer that hashes), every buffer byte
 * of the rows is hashed in order, skipped rows' included.
 */
static void move_rows(const lmcp_plane *p, const int64_t *slots, int64_t num_rows, int64_t first, int64_t last,
                      uint8_t *buffer, int direction, lmcp_cursor *cur, lmcp_checker *chk) {
    const int64_t plane_offset = p->buffer_prefix * num_rows;
    uint8_t *plane_rows = buffer + plane_offset;
    if (rows_interleaved(p) || !payload_is_dense(p)) {
        if (cur == NULL && chk == NULL) {
            move_strided(p, slots, first, last, plane_rows, direction);
            return;
        }
        int64_t span = LMCP_HASHED_SPAN_BYTES / p->row_bytes / LMCP_TILE * LMCP_TILE;
        if (span < LMCP_TILE) span = LMCP_TILE;
        for (int64_t f = first; f < last; f += span) {
            const int64_t e = f + span < last ? f + span : last;
            if (chk != NULL && !checked(chk, plane_offset + f * p->row_bytes, (e - f) * p->row_bytes)) return;
            move_strided(p, slots, f, e, plane_rows, direction);
            if (chk != NULL) hash_ahead(chk, (e - f) * p->row_bytes, 1);
            if (cur != NULL) cursor_take(cur, plane_rows + f * p->row_bytes, NULL, (e - f) * p->row_bytes);
        }
        return;
    }
    const int64_t ahead = p->row_bytes < LMCP_PREFETCH_BYTES ? LMCP_PREFETCH_BYTES / p->row_bytes : 1;
    int64_t prefetched = 0;
    int64_t r = first;
    while (r < last) {
        const int64_t slot = slots[r];
        if (slot < 0) {
            if (cur != NULL) cursor_take(cur, plane_rows + r * p->row_bytes, NULL, p->row_bytes);
            ++r;
            continue;
        }
        int64_t block = slot / p->rows_per_block, row = slot - block * p->rows_per_block;
        uint8_t *start = (uint8_t *)(intptr_t)(p->base + block * p->block_stride + row * p->row_stride);
        uint8_t *next = start + p->row_bytes;
        int64_t end = r + 1;
        while (end < last && slots[end] == slots[end - 1] + 1) {
            if (++row == p->rows_per_block) row = 0, ++block;
            if ((uint8_t *)(intptr_t)(p->base + block * p->block_stride + row * p->row_stride) != next) break;
            next += p->row_bytes;
            ++end;
        }
        if (direction == LMCP_STORE) prefetched = prefetch_rows(p, slots, num_rows, prefetched > end ? prefetched : end,
                                                                end + ahead);
        if (cur != NULL && direction == LMCP_STORE) {
            cursor_take(cur, plane_rows + r * p->row_bytes, start, (end - r) * p->row_bytes);
        } else if (cur != NULL) {
            cursor_take(cur, start, plane_rows + r * p->row_bytes, (end - r) * p->row_bytes);
        } else if (chk != NULL) {
            if (!move_run_checked(chk, start, plane_offset + r * p->row_bytes, buffer, (end - r) * p->row_bytes,
                                  p->row_bytes))
                return;
        } else {
            copy_run(start, plane_rows + r * p->row_bytes, (size_t)((end - r) * p->row_bytes), direction);
        }
        r = end;
    }
}

/*
 * Items a thread takes at once: about a quarter of its share, so each thread streams through long
 * contiguous stretches (64-item grabs interleaved the threads and cost a third of the store speed) while a
 * helper that joins late still finds work. Sized in bytes: a block row (a whole page) is a long item, and
 * 64 of them would leave the helper nothing to take.
 */
#define LMCP_MIN_GRAB_BYTES (16 * 1024)
#define LMCP_GRABS_PER_THREAD 4
/*
 * A checked load's grab hashes its first stripe before it copies anything (hashing ahead needs a copy to ride
 * on): fewer, longer grabs. Measured on deepseek-v4 (37 KB rows, 2 threads), hashing ahead: +35 % over a plain
 * load with 4 grabs a thread, +30 % with 2 (+29 % with 1, which a helper that joins late would find taken).
 */
#define LMCP_CHECKED_GRABS_PER_THREAD 2
#define LMCP_MAX_HELPERS 255

typedef struct {
    const lmcp_plane *planes;
    const int64_t *slots;
    int64_t slots_plane_stride;
    int64_t num_rows;
    int64_t items;
    int64_t grain;
    uint8_t *buffer;
    int direction;
    atomic_llong next; /* first item not yet taken */
    /* A store that hashes (else pieces is NULL): grab g writes its pieces from pieces + piece_base[g]. */
    int64_t origin; /* object offset of buffer[0] */
    int64_t stripe;
    lmcp_piece *pieces;
    const int64_t *piece_base;
    atomic_int miscounted; /* a grab wrote another number of pieces than planned: a bug, reported as -3 */
    lmcp_check *check;     /* a load that checks what it writes, else NULL */
} lmcp_job;

/* Buffer offset of item i's row (i == items: the end of the buffer). */
static int64_t item_offset(const lmcp_job *job, int64_t i) {
    const int64_t p = i / job->num_rows, r = i - p * job->num_rows;
    if (i == job->items) {
        const lmcp_plane *last = &job->planes[p - 1];
        return (last->buffer_prefix + last->row_bytes) * job->num_rows;
    }
    return job->planes[p].buffer_prefix * job->num_rows + r * job->planes[p].row_bytes;
}

static void run_items(lmcp_job *job) {
    const int64_t rows = job->num_rows;
    for (;;) {
        int64_t start = atomic_fetch_add_explicit(&job->next, job->grain, memory_order_relaxed);
        if (start >= job->items) {
            stream_fence();
            return;
        }
        int64_t end = start + job->grain < job->items ? start + job->grain : job->items;
        lmcp_cursor cursor, *cur = NULL;
        if (job->pieces != NULL) {
            const int64_t from = job->origin + item_offset(job, start), grab = start / job->grain;
            cursor = (lmcp_cursor){job->stripe, from, (from / job->stripe + 1) * job->stripe, from, 0,
                                   job->pieces + job->piece_base[grab],
                                   job->direction == LMCP_STORE ? LMCP_STREAM_STORE_BYTES : LMCP_STREAM_LOAD_BYTES};
            cur = &cursor;
        }
        lmcp_checker checker, *chk = NULL;
        if (job->check != NULL) {
            const int64_t from = job->check->origin + item_offset(job, start), stripe = job->check->stripe;
            const int64_t limit = job->check->origin + item_offset(job, end);
            checker = (lmcp_checker){job->check, limit, (from + stripe - 1) / stripe * stripe, -1, 0, 0};
            chk = &checker;
        }
        for (int64_t p = start / rows; p * rows < end; ++p) {
            int64_t first = p * rows > start ? 0 : start - p * rows;
            int64_t last = (p + 1) * rows < end ? rows : end - p * rows;
            move_rows(&job->planes[p], job->slots + p * job->slots_plane_stride, rows, first, last, job->buffer,
                      job->direction, cur, chk);
        }
        if (chk != NULL) hash_ahead(chk, INT64_MAX, 0); /* a claim is settled before the grab ends */
        if (cur != NULL) {
            cursor_emit(cur);
            if (cur->out != job->pieces + job->piece_base[start / job->grain + 1] ||
                cur->pos != job->origin + item_offset(job, end))
                atomic_store(&job->miscounted, 1);
        }
    }
}

static struct {
    pthread_mutex_t lock; /* guards every field below */
    pthread_cond_t wake;  /* helpers wait here for a job */
    pthread_cond_t idle;  /* the caller waits here for joined helpers to leave */
    lmcp_job *job;        /* the open job, or NULL */
    uint64_t generation;  /* bumped per job, so a helper joins each job at most once */
    int wanted;           /* helpers that may still join the open job */
    int active;           /* helpers inside the open job */
    int started;          /* helper threads alive */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0, 0};

/* One job at a time uses the helpers; a concurrent caller (store while loading) runs alone instead. */
static pthread_mutex_t submit = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/*
 * After a job a helper keeps watching for the next one for a short while before it sleeps: transfers come
 * in bursts (one call per transfer group and chunk), and a sleeping helper often wakes too late to help.
 */
#define LMCP_SPIN_NS 100000

static atomic_uint_fast64_t published; /* pool.generation, readable without the lock */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void watch_for_job(uint64_t seen) {
    const int64_t until = now_ns() + LMCP_SPIN_NS;
    for (unsigned i = 1;; ++i) {
        if (atomic_load_explicit(&published, memory_order_relaxed) != seen) return;
        lmcp_cpu_relax();
        if (i % 64 == 0 && now_ns() > until) return;
    }
}

static int job_for(uint64_t seen) { return pool.job != NULL && pool.generation != seen && pool.wanted > 0; }

static void *helper_main(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        if (!job_for(seen)) {
            pthread_mutex_unlock(&pool.lock);
            watch_for_job(seen);
            pthread_mutex_lock(&pool.lock);
            while (!job_for(seen)) pthread_cond_wait(&pool.wake, &pool.lock);
        }
        seen = pool.generation;
        pool.wanted--;
        pool.active++;
        lmcp_job *job = pool.job;
        pthread_mutex_unlock(&pool.lock);
        run_items(job);
        pthread_mutex_lock(&pool.lock);
        if (--pool.active == 0) pthread_cond_signal(&pool.idle);
    }
    return NULL;
}

/* A forked child has none of the parent's helpers: start from an empty pool. */
static void reset_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.idle, NULL);
    pthread_mutex_init(&submit, NULL);
    pool.job = NULL;
    pool.wanted = pool.active = pool.started = 0;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

/* Called with pool.lock held. Helpers block every signal: they belong to the interpreter's main thread. */
static void start_helpers(int count) {
    pthread_once(&atfork_once, register_atfork);
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    while (pool.started < count) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper_main, NULL) != 0) break;
        pthread_detach(thread);
        pool.started++;
    }
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
}

static void run_job(lmcp_job *job, int threads) {
    if (threads <= 1 || pthread_mutex_trylock(&submit) != 0) {
        run_items(job);
        return;
    }
    int helpers = threads - 1 < LMCP_MAX_HELPERS ? threads - 1 : LMCP_MAX_HELPERS;
    pthread_mutex_lock(&pool.lock);
    start_helpers(helpers);
    pool.job = job;
    pool.generation++;
    atomic_store_explicit(&published, pool.generation, memory_order_relaxed);
    pool.wanted = helpers < pool.started ? helpers : pool.started;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_items(job);
    pthread_mutex_lock(&pool.lock);
    pool.job = NULL; /* helpers that wake up from now on find no job */
    pool.wanted = 0;
    while (pool.active > 0) pthread_cond_wait(&pool.idle, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&submit);
}

/* The job moving rows between `num_planes` planes and `buffer` (see lmcp_transfer), threads and grain chosen. */
static int plan_job(lmcp_job *job, const lmcp_plane *planes, int64_t num_planes, const int64_t *slots,
                    int64_t slots_plane_stride, int64_t num_rows, uint8_t *buffer, int direction, int num_threads,
                    int grabs_per_thread) {
    int64_t total_bytes = 0;
    for (int64_t p = 0; p < num_planes; ++p) total_bytes += planes[p].row_bytes * num_rows;
    const int threads = total_bytes < LMCP_PARALLEL_MIN_BYTES || num_threads < 1 ? 1 : num_threads;
    const int64_t items = num_planes * num_rows;
    int64_t grab_bytes = total_bytes / ((int64_t)threads * grabs_per_thread);
    if (grab_bytes < LMCP_MIN_GRAB_BYTES) grab_bytes = LMCP_MIN_GRAB_BYTES;
    const int64_t item_bytes = items > 0 && total_bytes / items > 0 ? total_bytes / items : 1;
    *job = (lmcp_job){.planes = planes,
                      .slots = slots,
                      .slots_plane_stride = slots_plane_stride,
                      .num_rows = num_rows,
                      .items = items,
                      .grain = grab_bytes / item_bytes > 1 ? grab_bytes / item_bytes : 1,
                      .buffer = buffer,
                      .direction = direction};
    return threads;
}

/*
 * Moves rows between `num_planes` planes and `buffer`. `slots` holds `num_rows` int64 per plane, plane p's
 * list starting at `slots + p * slots_plane_stride` (stride 0: one list shared by every plane); slots < 0
 * are skipped. Inputs are validated by the caller. Uses up to `num_threads` threads (the caller included).
 * Returns 0, or -1 for an unknown direction.
 */
int lmcp_transfer(const lmcp_plane *planes, int64_t num_planes, const int64_t *slots, int64_t slots_plane_stride,
                  int64_t num_rows, uint8_t *buffer, int direction, int num_threads) {
    if (direction != LMCP_STORE && direction != LMCP_LOAD) return -1;
    lmcp_job job;
    const int threads =
        plan_job(&job, planes, num_planes, slots, slots_plane_stride, num_rows, buffer, direction, num_threads,
                 LMCP_GRABS_PER_THREAD);
    run_job(&job, threads);
    return 0;
}

/* lmcp_transfer_crc and lmcp_transfer_load_crc: the transfer in `direction`, hashing every buffer byte. */
static int transfer_crc(const lmcp_plane *planes, int64_t num_planes, const int64_t *slots, int64_t slots_plane_stride,
                        int64_t num_rows, uint8_t *buffer, int direction, int num_threads, int64_t origin,
                        int64_t stripe, int64_t payload, uint32_t *acc, int64_t *lens) {
    if (stripe <= 0 || origin < 0 || payload <= 0) return -1;
    lmcp_job job;
    const int threads = plan_job(&job, planes, num_planes, slots, slots_plane_stride, num_rows, buffer, direction,
                                 num_threads, LMCP_GRABS_PER_THREAD);
    if (job.items == 0) return 0;
    job.origin = origin;
    job.stripe = stripe;
    const int64_t grabs = (job.items + job.grain - 1) / job.grain;
    int64_t *base = malloc((size_t)(grabs + 1) * sizeof *base);
    if (base == NULL) return -2;
    base[0] = 0;
    for (int64_t g = 0; g < grabs; ++g) {
        const int64_t end = (g + 1) * job.grain < job.items ? (g + 1) * job.grain : job.items;
        const int64_t from = origin + item_offset(&job, g * job.grain), to = origin + item_offset(&job, end);
        base[g + 1] = base[g] + (to > from ? (to - 1) / stripe - from / stripe + 1 : 0);
    }
    lmcp_piece *pieces = malloc((size_t)(base[grabs] > 0 ? base[grabs] : 1) * sizeof *pieces);
    if (pieces == NULL) {
        free(base);
        return -2;
    }
    job.pieces = pieces;
    job.piece_base = base;
    run_job(&job, threads);
    int status = atomic_load(&job.miscounted) ? -3 : 0;
    for (int64_t i = 0; status == 0 && i < base[grabs]; ++i) {
        if (lmcp_crc_merge(pieces[i].offset, pieces[i].len, pieces[i].crc, stripe, payload, acc, lens) != 0)
            status = -4;
    }
    free(pieces);
    free(base);
    return status;
}

/*
 * lmcp_transfer's store that also hashes every byte it writes into `buffer`, which holds the bytes of a
 * `payload`-byte object from object offset `origin`: each `stripe`-byte stripe's raw CRC state joins acc/lens
 * (lmcp_crc_merge; zeroed for the object's first bytes; an object's calls in any order, each byte once), which
 * lmcp_crc32c_finish turns into the stripes' CRC-32Cs. Returns 0; -1 for a bad argument, -2 when out of
 * memory (nothing moved), -3 or -4 for a bug (a grab's pieces miscounted, or overrunning a stripe).
 */
int lmcp_transfer_crc(const lmcp_plane *planes, int64_t num_planes, const int64_t *slots, int64_t slots_plane_stride,
                      int64_t num_rows, uint8_t *buffer, int num_threads, int64_t origin, int64_t stripe,
                      int64_t payload, uint32_t *acc, int64_t *lens) {
    return transfer_crc(planes, num_planes, slots, slots_plane_stride, num_rows, buffer, LMCP_STORE, num_threads,
                        origin, stripe, payload, acc, lens);
}

/*
 * lmcp_transfer's load that also hashes every byte of `buffer` it reads, as lmcp_transfer_crc hashes a store's:
 * one pass over the object. The rows are written whatever their bytes; the caller compares the finished stripe
 * CRCs with those the object carries and fails the load (before anything reads the rows) when they differ.
 * Returns as lmcp_transfer_crc (-2: nothing moved).
 */
int lmcp_transfer_load_crc(const lmcp_plane *planes, int64_t num_planes, const int64_t *slots,
                           int64_t slots_plane_stride, int64_t num_rows, uint8_t *buffer, int num_threads,
                           int64_t origin, int64_t stripe, int64_t payload, uint32_t *acc, int64_t *lens) {
    return transfer_crc(planes, num_planes, slots, slots_plane_stride, num_rows, buffer, LMCP_LOAD, num_threads,
                        origin, stripe, payload, acc, lens);
}

/*
 * lmcp_transfer's load that checks what it writes: `buffer` holds the bytes at object offset `origin` of the
 * `payload`-byte object at `object`, whose stripes' CRC-32Cs are `expected`; `state` (one per stripe, zeroed
 * for the object's first call) records which stripes were checked, across the object's calls. Returns 0 when
 * every row was written; 1 when a stripe did not match: the load stopped, and only bytes of stripes that
 * matched were written; -1 for a bad argument.
 */
int lmcp_transfer_checked(const lmcp_plane *planes, int64_t num_planes, const int64_t *slots,
                          int64_t slots_plane_stride, int64_t num_rows, uint8_t *buffer, int num_threads,
                          int64_t origin, const uint8_t *object, int64_t payload, int64_t stripe,
                          const uint32_t *expected, uint32_t *state) {
    if (stripe <= 0 || origin < 0 || object == NULL) return -1;
    lmcp_job job;
    const int threads =
        plan_job(&job, planes, num_planes, slots, slots_plane_stride, num_rows, buffer, LMCP_LOAD, num_threads,
                 LMCP_CHECKED_GRABS_PER_THREAD);
    lmcp_check check = {object, payload, stripe, origin, expected, (atomic_uint *)state, 0};
    job.check = &check;
    run_job(&job, threads);
    return atomic_load(&check.bad) ? 1 : 0;
}

/* Lets the loader check it got a library built with its plane table. */
int lmcp_abi_version(void) { return LMCP_ABI_VERSION; }
