/*
 * The CRC-32C pieces the transfer kernel (kv_transfer.c) hashes a store with, from crc32c.c. A "raw" state
 * is the CRC register without the initial value or final inversion: lmcp_crc_raw(0, ...) of a piece, joined
 * to the other pieces of its stripe by lmcp_crc_merge.
 */
#ifndef LMCP_CRC32C_H
#define LMCP_CRC32C_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

enum { LMCP_CRC_HASH = 0, LMCP_CRC_COPY = 1, LMCP_CRC_STREAM = 2 };

/* One step of a spin wait (a checked load's wait for a stripe's verdict, the pool's wait for a job). */
static inline void lmcp_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* `crc` continued over p[0, n). */
uint32_t lmcp_crc_raw(uint32_t crc, const uint8_t *p, size_t n);

/* Whether lmcp_crc_copy_fold hashes inside the copy (a carry-less fold); else it copies, then hashes. */
int lmcp_crc_folds(void);

/*
 * Copies src[0, n) to dst (streaming stores if `stream`) and returns `crc` continued over those bytes, hashed
 * inside the copy loop where lmcp_crc_folds() (without it: a plain copy, then a hash of the source).
 */
uint32_t lmcp_crc_copy_fold(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc, int stream);

/*
 * Copies src[0, n) to dst (streaming stores if `stream`) and returns `crc` continued over other bytes,
 * hash[0, n): the hash rides on the copy's loop where lmcp_crc_folds().
 */
uint32_t lmcp_crc_copy_beside(uint8_t *dst, const uint8_t *src, size_t n, const uint8_t *hash, uint32_t crc,
                              int stream);

/*
 * Joins the raw state `crc` of the `len` bytes at offset `offset` (inside one stripe) of a `payload`-byte
 * object to that stripe's state acc[k] / lens[k], in any order: acc[k] is the xor of each piece's state moved
 * past the stripe's bytes after it. 0, or -1 when the piece overruns the stripe.
 */
int lmcp_crc_merge(int64_t offset, int64_t len, uint32_t crc, int64_t stripe, int64_t payload, uint32_t *acc,
                   int64_t *lens);

/*
 * A checked load's stripes: each is hashed once, by the first thread whose rows need it, and compared with
 * the CRC the object carries; the others wait for the verdict.
 */
enum { LMCP_STRIPE_NEW = 0, LMCP_STRIPE_BUSY = 1, LMCP_STRIPE_GOOD = 2, LMCP_STRIPE_BAD = 3 };

/*
 * 1 when every stripe of the `payload`-byte object overlapping its bytes [from, to) matches `expected`
 * (hashing those still new in `state`, waiting for those another thread is hashing); 0 at the first that does
 * not.
 */
int lmcp_crc_check(const uint8_t *object, int64_t payload, int64_t stripe, const uint32_t *expected,
                   atomic_uint *state, int64_t from, int64_t to);

#endif
