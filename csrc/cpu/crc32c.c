/*
 * CRC-32C (Castagnoli; reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF) of the
 * stripes of a buffer: the checksum of every chunk object lmcache_platforms stores (connector/checksum.py).
 *
 * Four ways to the same values. x86-64 CPUs with AVX-512 and VPCLMULQDQ fold 256 bytes per step with
 * carry-less multiplies (four 512-bit accumulators, each 128-bit lane a polynomial congruent to the bytes seen
 * so far, moved forward by multiplying with x^k mod P), then reduce the last 16 bytes with the crc32
 * instruction. The fold also runs inside a copy (lmcp_crc_copy_fold), so a store or load hashes the bytes it
 * moves while they are in registers instead of reading them again; there CPUs with VPCLMULQDQ and AVX2 but no
 * AVX-512 fold with four 256-bit lanes, 128 bytes per step, and other x86-64 CPUs with PCLMULQDQ (all since
 * 2010) with four 128-bit lanes, 64 bytes per step. Otherwise the crc32 instruction runs on
 * three stripes (or thirds of one buffer) at once, since one stream is bound by its 3-cycle latency; aarch64
 * CPUs with the CRC extension (ARMv8.1 on, and most ARMv8.0 server cores) do the same with their crc32c
 * instruction; elsewhere a table (eight bytes per step). Pieces hashed apart are joined by shifting
 * (lmcp_crc_merge; the CRC is linear: a piece's state moves past the n bytes after it in its stripe by a
 * multiplication with x^(8n) mod P, carry-less where the CPU can, so pieces join in any order). Called from
 * several threads at once; it keeps no state but its tables, built once.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define LMCP_CRC_HW 1
#define CRC_HW_TARGET __attribute__((target("sse4.2")))
#define CRC_U64(c, w) _mm_crc32_u64((c), (w))
#define CRC_U8(c, b) _mm_crc32_u8((c), (b))
#elif defined(__aarch64__) && defined(__linux__)
#include <arm_acle.h>
#include <arm_neon.h>
#include <sys/auxv.h>
#define LMCP_CRC_HW 1
#define CRC_HW_TARGET __attribute__((target("+crc")))
#define CRC_U64(c, w) __crc32cd((uint32_t)(c), (w))
#define CRC_U8(c, b) __crc32cb((c), (b))
#endif

#include "crc32c.h"

#define CASTAGNOLI 0x82F63B78u

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_table(void) {
    for (uint32_t byte = 0; byte < 256; byte++) {
        uint32_t crc = byte;
        for (int bit = 0; bit < 8; bit++) crc = (crc >> 1) ^ (CASTAGNOLI & (0u - (crc & 1u)));
        table[0][byte] = crc;
    }
    for (uint32_t byte = 0; byte < 256; byte++)
        for (int k = 1; k < 8; k++) table[k][byte] = (table[k - 1][byte] >> 8) ^ table[0][table[k - 1][byte] & 0xFF];
}

/* Continue `crc` (not inverted) over bytes p[0, n) with the table. */
static uint32_t crc_table(uint32_t crc, const uint8_t *p, size_t n) {
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t word;
        memcpy(&word, p, 8); /* little-endian hosts only, as every platform this package builds for */
        word ^= crc;
        crc = table[7][word & 0xFF] ^ table[6][(word >> 8) & 0xFF] ^ table[5][(word >> 16) & 0xFF] ^
              table[4][(word >> 24) & 0xFF] ^ table[3][(word >> 32) & 0xFF] ^ table[2][(word >> 40) & 0xFF] ^
              table[1][(word >> 48) & 0xFF] ^ table[0][word >> 56];
    }
    for (; n; n--, p++) crc = (crc >> 8) ^ table[0][(crc ^ *p) & 0xFF];
    return crc;
}

#if defined(LMCP_CRC_HW)
/* The CPU's CRC-32C instruction: SSE 4.2's crc32 on x86-64, ARMv8's crc32c (the CRC extension) on aarch64. */
CRC_HW_TARGET static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = CRC_U64(c, word);
    }
    for (; n; n--, p++) c = CRC_U8((uint32_t)c, *p);
    return (uint32_t)c;
}

/* Three stripes of `n` bytes each, interleaved: out[0..2] hold their starting states and get their results. */
CRC_HW_TARGET static void crc_hw3(const uint8_t *a, const uint8_t *b, const uint8_t *c, size_t n, uint32_t out[3]) {
    uint64_t ca = out[0], cb = out[1], cc = out[2];
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t wa, wb, wc;
        memcpy(&wa, a + i, 8);
        memcpy(&wb, b + i, 8);
        memcpy(&wc, c + i, 8);
        ca = CRC_U64(ca, wa);
        cb = CRC_U64(cb, wb);
        cc = CRC_U64(cc, wc);
    }
    out[0] = crc_hw((uint32_t)ca, a + i, n - i);
    out[1] = crc_hw((uint32_t)cb, b + i, n - i);
    out[2] = crc_hw((uint32_t)cc, c + i, n - i);
}

#if defined(__x86_64__)
static int have_hw(void) { return __builtin_cpu_supports("sse4.2"); }
#else
/* HWCAP_CRC32 of the kernel's aarch64 hwcaps (asm/hwcap.h), spelled out so the header is not needed. */
static int have_hw(void) { return (getauxval(AT_HWCAP) & (1UL << 7)) != 0; }
#endif
#else
static int have_hw(void) { return 0; }
#endif

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 10
#define LMCP_FOLD 1
#define FOLD128_TARGET __attribute__((target("pclmul,sse4.2")))
#define FOLD256_TARGET __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2")))
#define FOLD512_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

/*
 * Multipliers that move a 128-bit lane forward by d bytes: its low quadword (the higher-degree half, the
 * CRC being reflected) times x^(8d+31) mod P, its high one times x^(8d-33) mod P, the products (reflected,
 * one bit short of aligned) landing where the lane's next 16 bytes sit. Index: d = 16, 32, 48, 64, 128, 256.
 */
enum { FOLD_16, FOLD_32, FOLD_48, FOLD_64, FOLD_128, FOLD_256, FOLD_DISTANCES };
static uint64_t fold_low[FOLD_DISTANCES], fold_high[FOLD_DISTANCES];

FOLD128_TARGET static inline __m128i fold_pair(int d) {
    return _mm_set_epi64x((long long)fold_high[d], (long long)fold_low[d]);
}

FOLD128_TARGET static inline __m128i fold128(__m128i x, int d) {
    const __m128i k = fold_pair(d);
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

/* The CRC register of four 16-byte lanes in byte order (the last one's end is the bytes' end). */
FOLD128_TARGET static inline uint32_t reduce_lanes(__m128i l0, __m128i l1, __m128i l2, __m128i l3) {
    const __m128i high = _mm_xor_si128(fold128(l0, FOLD_48), fold128(l1, FOLD_32));
    const __m128i lane = _mm_xor_si128(high, _mm_xor_si128(fold128(l2, FOLD_16), l3));
    const uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(lane));
    return (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(lane, 1));
}

FOLD128_TARGET static inline void put128(uint8_t *dst, __m128i v, int mode) {
    if (mode == LMCP_CRC_STREAM) {
        _mm_stream_si128((__m128i *)dst, v);
    } else if (mode == LMCP_CRC_COPY) {
        _mm_storeu_si128((__m128i *)dst, v);
    }
}

/*
 * `crc` continued over hash[0, n), n a positive multiple of 64, copying src[0, n) to dst per `mode`: 4 x 128-bit
 * lanes. `beside` (a constant where inlined): src holds other bytes; else src is hash, loaded once.
 */
FOLD128_TARGET static inline __attribute__((always_inline)) uint32_t
fold_blocks_128(uint8_t *dst, const uint8_t *src, const uint8_t *hash, size_t n, uint32_t crc, int mode, int beside) {
    __m128i a[4];
    for (int j = 0; j < 4; ++j) {
        a[j] = _mm_loadu_si128((const __m128i *)(hash + 16 * j));
        put128(dst + 16 * j, beside ? _mm_loadu_si128((const __m128i *)(src + 16 * j)) : a[j], mode);
    }
    a[0] = _mm_xor_si128(a[0], _mm_cvtsi32_si128((int)crc));
    const __m128i k64 = fold_pair(FOLD_64);
    for (size_t i = 64; i < n; i += 64) {
        __m128i b[4];
        for (int j = 0; j < 4; ++j) {
            b[j] = _mm_loadu_si128((const __m128i *)(hash + i + 16 * j));
            put128(dst + i + 16 * j, beside ? _mm_loadu_si128((const __m128i *)(src + i + 16 * j)) : b[j], mode);
        }
        for (int j = 0; j < 4; ++j)
            a[j] = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a[j], k64, 0x00),
                                               _mm_clmulepi64_si128(a[j], k64, 0x11)), b[j]);
    }
    return reduce_lanes(a[0], a[1], a[2], a[3]);
}

FOLD256_TARGET static inline __m256i fold256(__m256i x, __m256i k, __m256i next) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11)),
                            next);
}

FOLD256_TARGET static inline void put256(uint8_t *dst, __m256i v, int mode) {
    if (mode == LMCP_CRC_STREAM) {
        _mm256_stream_si256((__m256i *)dst, v);
    } else if (mode == LMCP_CRC_COPY) {
        _mm256_storeu_si256((__m256i *)dst, v);
    }
}

/*
 * fold_blocks_128 with 4 x 256-bit lanes, n a positive multiple of 128: CPUs with VPCLMULQDQ but no AVX-512
 * (AMD Zen 3, Intel's client cores), where the 128-bit fold inside a copy cost a load or store 25-40 %.
 */
FOLD256_TARGET static inline __attribute__((always_inline)) uint32_t
fold_blocks_256(uint8_t *dst, const uint8_t *src, const uint8_t *hash, size_t n, uint32_t crc, int mode, int beside) {
    __m256i a[4];
    for (int j = 0; j < 4; ++j) {
        a[j] = _mm256_loadu_si256((const __m256i *)(hash + 32 * j));
        put256(dst + 32 * j, beside ? _mm256_loadu_si256((const __m256i *)(src + 32 * j)) : a[j], mode);
    }
    a[0] = _mm256_xor_si256(a[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)crc)));
    const __m256i k128 = _mm256_broadcastsi128_si256(fold_pair(FOLD_128));
    for (size_t i = 128; i < n; i += 128) {
        __m256i b[4];
        for (int j = 0; j < 4; ++j) {
            b[j] = _mm256_loadu_si256((const __m256i *)(hash + i + 32 * j));
            put256(dst + i + 32 * j, beside ? _mm256_loadu_si256((const __m256i *)(src + i + 32 * j)) : b[j], mode);
        }
        for (int j = 0; j < 4; ++j) a[j] = fold256(a[j], k128, b[j]);
    }
    const __m256i k32 = _mm256_broadcastsi128_si256(fold_pair(FOLD_32));
    const __m256i x = fold256(fold256(fold256(a[0], k32, a[1]), k32, a[2]), k32, a[3]);
    const __m128i zero = _mm_setzero_si128();
    return reduce_lanes(zero, zero, _mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

FOLD512_TARGET static inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), next,
                                     0x96);
}

FOLD512_TARGET static inline void put512(uint8_t *dst, __m512i v, int mode) {
    if (mode == LMCP_CRC_STREAM) {
        _mm512_stream_si512((void *)dst, v);
    } else if (mode == LMCP_CRC_COPY) {
        _mm512_storeu_si512(dst, v);
    }
}

/* fold_blocks_128 with 4 x 512-bit lanes, n a positive multiple of 256. */
FOLD512_TARGET static inline __attribute__((always_inline)) uint32_t
fold_blocks_512(uint8_t *dst, const uint8_t *src, const uint8_t *hash, size_t n, uint32_t crc, int mode, int beside) {
    __m512i a[4];
    for (int j = 0; j < 4; ++j) {
        a[j] = _mm512_loadu_si512(hash + 64 * j);
        put512(dst + 64 * j, beside ? _mm512_loadu_si512(src + 64 * j) : a[j], mode);
    }
    a[0] = _mm512_xor_si512(a[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)crc)));
    const __m512i k256 = _mm512_broadcast_i32x4(fold_pair(FOLD_256));
    for (size_t i = 256; i < n; i += 256) {
        __m512i b[4];
        for (int j = 0; j < 4; ++j) {
            b[j] = _mm512_loadu_si512(hash + i + 64 * j);
            put512(dst + i + 64 * j, beside ? _mm512_loadu_si512(src + i + 64 * j) : b[j], mode);
        }
        for (int j = 0; j < 4; ++j) a[j] = fold512(a[j], k256, b[j]);
    }
    const __m512i k64 = _mm512_broadcast_i32x4(fold_pair(FOLD_64));
    __m512i x = fold512(fold512(fold512(a[0], k64, a[1]), k64, a[2]), k64, a[3]);
    return reduce_lanes(_mm512_extracti32x4_epi32(x, 0), _mm512_extracti32x4_epi32(x, 1),
                        _mm512_extracti32x4_epi32(x, 2), _mm512_extracti32x4_epi32(x, 3));
}

FOLD512_TARGET static uint32_t fold_own_512(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc, int mode) {
    return fold_blocks_512(dst, src, src, n, crc, mode, 0);
}
FOLD512_TARGET static uint32_t fold_beside_512(uint8_t *dst, const uint8_t *src, const uint8_t *hash, size_t n,
                                               uint32_t crc, int mode) {
    return fold_blocks_512(dst, src, hash, n, crc, mode, 1);
}
FOLD256_TARGET static uint32_t fold_own_256(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc, int mode) {
    return fold_blocks_256(dst, src, src, n, crc, mode, 0);
}
FOLD256_TARGET static uint32_t fold_beside_256(uint8_t *dst, const uint8_t *src, const uint8_t *hash, size_t n,
                                               uint32_t crc, int mode) {
    return fold_blocks_256(dst, src, hash, n, crc, mode, 1);
}
FOLD128_TARGET static uint32_t fold_own_128(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc, int mode) {
    return fold_blocks_128(dst, src, src, n, crc, mode, 0);
}
FOLD128_TARGET static uint32_t fold_beside_128(uint8_t *dst, const uint8_t *src, const uint8_t *hash, size_t n,
                                               uint32_t crc, int mode) {
    return fold_blocks_128(dst, src, hash, n, crc, mode, 1);
}

/*
 * `crc` continued over hash[0, n), n >= 2 * step, copying src[0, n) to dst per `mode` (streaming stores once
 * dst is aligned to the vector), with `step`-byte steps of fold_blocks_512 (256), fold_blocks_256 (128) or
 * fold_blocks_128 (64).
 */
static uint32_t fold_any(uint8_t *dst, const uint8_t *src, const uint8_t *hash, size_t n, uint32_t crc, int mode,
                         size_t step) {
    const size_t align = step / 4;
    size_t head = mode == LMCP_CRC_STREAM ? (align - ((uintptr_t)dst & (align - 1))) & (align - 1) : 0;
    if (head) {
        memcpy(dst, src, head);
        crc = crc_hw(crc, hash, head);
    }
    size_t body = (n - head) / step * step;
    uint8_t *to = mode ? dst + head : NULL;
    if (hash != src) {
        crc = step == 256   ? fold_beside_512(to, src + head, hash + head, body, crc, mode)
              : step == 128 ? fold_beside_256(to, src + head, hash + head, body, crc, mode)
                            : fold_beside_128(to, src + head, hash + head, body, crc, mode);
    } else {
        crc = step == 256   ? fold_own_512(to, src + head, body, crc, mode)
              : step == 128 ? fold_own_256(to, src + head, body, crc, mode)
                            : fold_own_128(to, src + head, body, crc, mode);
    }
    size_t done = head + body;
    if (mode) memcpy(dst + done, src + done, n - done);
    return crc_hw(crc, hash + done, n - done);
}

/* The widest fold this CPU runs: 512 (AVX-512 with VPCLMULQDQ), 256 (AVX2 with it), 128 (PCLMULQDQ), or 0. */
static int fold_hardware(void) {
    if (!have_hw() || !__builtin_cpu_supports("pclmul")) return 0;
    if (!__builtin_cpu_supports("vpclmulqdq")) return 128;
    return __builtin_cpu_supports("avx512f") ? 512 : __builtin_cpu_supports("avx2") ? 256 : 128;
}
#else
static int fold_hardware(void) { return 0; }
#endif

/* The widest fold tests allow (lmcp_crc32c_allow_vectors); the values are the same every way. */
static atomic_int vectors_allowed = 512;

/* x^(8 * 2^i) mod P, reflected: moving a CRC state past 2^i bytes multiplies it by power_of_bytes[i]. */
static uint32_t power_of_bytes[64];
/* x^(8 * 2^i - 32) mod P for i >= 2, the same for multiply_clmul. */
static uint32_t power_of_bytes_less_32[64];

/* a * b mod P, both reflected (bit 31 holds x^0). */
static uint32_t multiply(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int bit = 0; bit < 32; bit++) {
        if (a & 0x80000000u) product ^= b;
        a <<= 1;
        b = (b >> 1) ^ (CASTAGNOLI & (0u - (b & 1u)));
    }
    return product;
}

/* x^n mod P, reflected. */
static uint32_t x_to_the(uint64_t n) {
    uint32_t result = 0x80000000u, square = 0x40000000u;
    for (; n; n >>= 1, square = multiply(square, square))
        if (n & 1) result = multiply(result, square);
    return result;
}

static void build_tables(void) {
    build_table();
    for (int i = 0; i < 64; i++) {
        power_of_bytes[i] = i < 61 ? x_to_the((uint64_t)8 << i) : 0;
        power_of_bytes_less_32[i] = i >= 2 && i < 61 ? x_to_the(((uint64_t)8 << i) - 32) : 0;
    }
#if defined(LMCP_FOLD)
    const int distance[FOLD_DISTANCES] = {16, 32, 48, 64, 128, 256};
    for (int d = 0; d < FOLD_DISTANCES; d++) {
        fold_low[d] = x_to_the((uint64_t)8 * distance[d] + 31);
        fold_high[d] = x_to_the((uint64_t)8 * distance[d] - 33);
    }
#endif
}

/* The fold in use: the hardware's widest that tests allow (512, 256, 128), or 0. */
static int fold_width(void) {
    const int allowed = atomic_load_explicit(&vectors_allowed, memory_order_relaxed), have = fold_hardware();
    if (have <= allowed) return have;
    if (allowed >= 256 && have == 512) return 256; /* every AVX-512 CPU has AVX2 */
    return allowed >= 128 && have ? 128 : 0;
}

/* a * b * x^32 mod P, both reflected: their carry-less product (one bit short of aligned) reduced by crc32. */
#if defined(LMCP_FOLD)
#define LMCP_CLMUL 1
FOLD128_TARGET static uint32_t multiply_clmul(uint32_t a, uint32_t b) {
    const __m128i product = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)a), _mm_cvtsi32_si128((int)b), 0x00);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(product) << 1);
}

/* Whether shifts multiply carry-lessly: PCLMULQDQ, unless tests capped the vectors at 0. */
static int multiplies_carryless(void) { return fold_width() != 0; }
#elif defined(LMCP_CRC_HW) && defined(__aarch64__)
#define LMCP_CLMUL 1
__attribute__((target("+crc+crypto"))) static uint32_t multiply_clmul(uint32_t a, uint32_t b) {
    const poly128_t product = vmull_p64((poly64_t)a, (poly64_t)b);
    return __crc32cd(0, (uint64_t)product << 1);
}

/* PMULL (HWCAP_PMULL of the kernel's aarch64 hwcaps) and the crc32c instruction, unless tests capped the
   vectors at 0. */
static int multiplies_carryless(void) {
    return have_hw() && (getauxval(AT_HWCAP) & (1UL << 4)) && atomic_load(&vectors_allowed) != 0;
}
#endif

/*
 * `crc` moved past n zero bytes (tables built). With PCLMULQDQ (PMULL on aarch64) each power of two from 4
 * bytes on is one carry-less multiply by x^(8 * 2^i - 32) (multiply_clmul adds the x^32), not a 32-step loop:
 * a 64 KiB stripe hashed in three thirds took 2.8 us instead of 3.2 (one thread of an AMD EPYC, from cache, a
 * ctypes call each).
 */
static uint32_t shift(uint32_t crc, int64_t n) {
    int i = 0;
#if defined(LMCP_CLMUL)
    if (multiplies_carryless()) {
        for (; crc && n > 0 && i < 2; i++, n >>= 1)
            if (n & 1) crc = multiply(crc, power_of_bytes[i]);
        for (; crc && n > 0 && i < 61; i++, n >>= 1)
            if (n & 1) crc = multiply_clmul(crc, power_of_bytes_less_32[i]);
        return crc;
    }
#endif
    for (; crc && n > 0 && i < 61; i++, n >>= 1)
        if (n & 1) crc = multiply(crc, power_of_bytes[i]);
    return crc;
}

/* From this length the crc32 instruction hashes one buffer as three thirds at once, joined by shifting. */
#define THIRDS_MIN_BYTES 4096

static uint32_t crc_any(uint32_t crc, const uint8_t *p, size_t n) {
#if defined(LMCP_FOLD)
    /* Hashing alone, the 128-bit fold loses to three crc32 streams (12.8 against 22 GB/s a thread on an AMD
       EPYC with AVX-512); inside a copy it is hidden by the memory traffic, so only copies use it. */
    if (n >= 512 && fold_width() == 512) return fold_any(NULL, p, p, n, crc, LMCP_CRC_HASH, 256);
#endif
#if defined(LMCP_CRC_HW)
    if (have_hw() && n >= THIRDS_MIN_BYTES) {
        const size_t third = n / 3 & ~(size_t)7;
        uint32_t three[3] = {crc, 0, 0};
        crc_hw3(p, p + third, p + 2 * third, third, three);
        crc = shift(three[0], 2 * (int64_t)third) ^ shift(three[1], (int64_t)third) ^ three[2];
        return crc_hw(crc, p + 3 * third, n - 3 * third);
    }
    if (have_hw()) return crc_hw(crc, p, n);
#endif
    return crc_table(crc, p, n);
}

uint32_t lmcp_crc_raw(uint32_t crc, const uint8_t *p, size_t n) {
    pthread_once(&table_once, build_tables);
    return crc_any(crc, p, n);
}

int lmcp_crc_folds(void) {
    pthread_once(&table_once, build_tables);
    return fold_width() != 0;
}

uint32_t lmcp_crc_copy_fold(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc, int stream) {
    return lmcp_crc_copy_beside(dst, src, n, src, crc, stream); /* fold_any loads each byte once when hash == src */
}

uint32_t lmcp_crc_copy_beside(uint8_t *dst, const uint8_t *src, size_t n, const uint8_t *hash, uint32_t crc,
                              int stream) {
    pthread_once(&table_once, build_tables);
#if defined(LMCP_FOLD)
    const int width = fold_width(), mode = stream ? LMCP_CRC_STREAM : LMCP_CRC_COPY;
    if (width == 512 && n >= 512) return fold_any(dst, src, hash, n, crc, mode, 256);
    if (width == 256 && n >= 256) return fold_any(dst, src, hash, n, crc, mode, 128);
    if (width == 128 && n >= 256) return fold_any(dst, src, hash, n, crc, mode, 64);
#endif
    memcpy(dst, src, n);
    return crc_any(crc, hash, n);
}

int lmcp_crc_merge(int64_t offset, int64_t len, uint32_t crc, int64_t stripe, int64_t payload, uint32_t *acc,
                   int64_t *lens) {
    pthread_once(&table_once, build_tables);
    const int64_t k = offset / stripe, end = (k + 1) * stripe < payload ? (k + 1) * stripe : payload;
    if (len < 0 || offset + len > end || lens[k] + len > end - k * stripe) return -1;
    acc[k] ^= shift(crc, end - offset - len);
    lens[k] += len;
    return 0;
}

int lmcp_crc_check(const uint8_t *object, int64_t payload, int64_t stripe, const uint32_t *expected,
                   atomic_uint *state, int64_t from, int64_t to) {
    pthread_once(&table_once, build_tables);
    for (int64_t k = from / stripe; from < to && k <= (to - 1) / stripe; k++) {
        unsigned seen = atomic_load_explicit(&state[k], memory_order_acquire);
        if (seen == LMCP_STRIPE_NEW &&
            atomic_compare_exchange_strong_explicit(&state[k], &seen, LMCP_STRIPE_BUSY, memory_order_acq_rel,
                                                    memory_order_acquire)) {
            const int64_t start = k * stripe, len = payload - start < stripe ? payload - start : stripe;
            const uint32_t crc = ~crc_any(0xFFFFFFFFu, object + start, (size_t)len);
            seen = crc == expected[k] ? LMCP_STRIPE_GOOD : LMCP_STRIPE_BAD;
            atomic_store_explicit(&state[k], seen, memory_order_release);
        }
        while (seen == LMCP_STRIPE_BUSY) {
            lmcp_cpu_relax();
            seen = atomic_load_explicit(&state[k], memory_order_acquire);
        }
        if (seen != LMCP_STRIPE_GOOD) return 0;
    }
    return 1;
}

/*
 * 1 when every stripe of the `payload`-byte object that overlaps its bytes [from, to) matches its CRC-32C in
 * `expected`, checking those `state` (one per stripe, zeroed for a new object) does not mark checked yet; 0 at
 * the first that does not.
 */
int lmcp_crc32c_check(const uint8_t *object, int64_t payload, int64_t stripe, const uint32_t *expected,
                      uint32_t *state, int64_t from, int64_t to) {
    return lmcp_crc_check(object, payload, stripe, expected, (atomic_uint *)state, from, to);
}

/* CRC-32C of data[0, n). */
uint32_t lmcp_crc32c(const uint8_t *data, int64_t n) { return ~lmcp_crc_raw(0xFFFFFFFFu, data, (size_t)n); }

/*
 * CRC-32C of stripes first..last-1 of data[0, n) cut into `stripe`-byte pieces (the last may be shorter),
 * into out[0 .. last-first).
 */
void lmcp_crc32c_stripes(const uint8_t *data, int64_t n, int64_t stripe, int64_t first, int64_t last,
                         uint32_t *out) {
    pthread_once(&table_once, build_tables);
    int64_t k = first;
#if defined(LMCP_CRC_HW)
    if (have_hw() && fold_width() != 512) {
        for (; k + 3 <= last && (k + 3) * stripe <= n; k += 3) {
            uint32_t three[3] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
            const uint8_t *p = data + k * stripe;
            crc_hw3(p, p + stripe, p + 2 * stripe, (size_t)stripe, three);
            for (int j = 0; j < 3; j++) out[k - first + j] = ~three[j];
        }
    }
#endif
    for (; k < last; k++) {
        int64_t start = k * stripe, end = start + stripe < n ? start + stripe : n;
        out[k - first] = ~crc_any(0xFFFFFFFFu, data + start, (size_t)(end > start ? end - start : 0));
    }
}

/*
 * Adds data[0, n), the `payload`-byte object's bytes at `offset`, to the stripe states acc/lens (one uint32
 * and one int64 per stripe, zeroed before the object's first bytes); an object's bytes may come in any order.
 * 0, or -1 when they overrun a stripe (bytes beyond the payload, or more than once).
 */
int lmcp_crc32c_accumulate(const uint8_t *data, int64_t n, int64_t offset, int64_t stripe, int64_t payload,
                           uint32_t *acc, int64_t *lens) {
    pthread_once(&table_once, build_tables);
    while (n > 0) {
        const int64_t room = (offset / stripe + 1) * stripe - offset, m = n < room ? n : room;
        if (lmcp_crc_merge(offset, m, crc_any(0, data, (size_t)m), stripe, payload, acc, lens) != 0) return -1;
        data += m, offset += m, n -= m;
    }
    return 0;
}

/*
 * The CRC-32C of each stripe of a `payload`-byte object from its stripe states, into out. 0, or -1 when a
 * stripe's state does not cover exactly its bytes (some bytes never came, or came twice).
 */
int lmcp_crc32c_finish(int64_t payload, int64_t stripe, const uint32_t *acc, const int64_t *lens, uint32_t *out) {
    pthread_once(&table_once, build_tables);
    const int64_t count = (payload + stripe - 1) / stripe;
    const uint32_t whole = shift(0xFFFFFFFFu, stripe);
    for (int64_t k = 0; k < count; k++) {
        const int64_t want = payload - k * stripe < stripe ? payload - k * stripe : stripe;
        if (lens[k] != want) return -1;
        out[k] = ~((want == stripe ? whole : shift(0xFFFFFFFFu, want)) ^ acc[k]);
    }
    return 0;
}

/*
 * Finishes the stripe states of `n` objects of `payload` bytes (acc/lens: `count` stripes per object, the objects
 * back to back) and compares each object's CRC-32Cs with its expected ones at expected + i * stride; bad[i] says
 * whether they differ. Returns how many differ; -1 when a stripe's bytes did not all come exactly once (a bug).
 */
int64_t lmcp_crc32c_verify_all(int64_t n, int64_t payload, int64_t stripe, const uint32_t *acc, const int64_t *lens,
                               const uint32_t *expected, int64_t stride, uint8_t *bad) {
    if (payload <= 0 || stripe <= 0) return -1;
    pthread_once(&table_once, build_tables);
    const int64_t count = (payload + stripe - 1) / stripe, last = payload - (count - 1) * stripe;
    const uint32_t whole = shift(0xFFFFFFFFu, stripe), partial = shift(0xFFFFFFFFu, last);
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++) {
        bad[i] = 0;
        for (int64_t k = 0; k < count; k++) {
            const int64_t at = i * count + k, want = k == count - 1 ? last : stripe;
            if (lens[at] != want) return -1;
            if (~((want == stripe ? whole : partial) ^ acc[at]) != expected[i * stride + k]) bad[i] = 1;
        }
        differ += bad[i];
    }
    return differ;
}

static uint32_t load_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void store_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/*
 * An object's tail, right after its `payload` bytes: its `count` stripes' CRC-32Cs, then the trailer, the
 * CRC-32C of that table and a 4-byte mark, every value little-endian. One call per batch of objects, whose
 * addresses come in an array: inside a busy engine each tensor operation or ctypes call per object costs
 * several microseconds.
 */

/* The trailer's bytes: the table's CRC-32C and the mark. */
#define LMCP_TRAILER_BYTES 8

/* Writes the tail of `count` stripes from `stripes`, then the trailer with `mark`. */
static void seal_one(uint8_t *object, int64_t payload, int64_t count, const uint32_t *stripes, uint32_t mark) {
    uint8_t *table = object + payload;
    for (int64_t k = 0; k < count; k++) store_le32(table + 4 * k, stripes[k]);
    store_le32(table + 4 * count, lmcp_crc32c(table, 4 * count));
    store_le32(table + 4 * count + 4, mark);
}

/* seal_one for each of the `n` objects at `objects`, object i's stripe CRCs at stripes + i * count. */
void lmcp_crc32c_seal_all(const uint64_t *objects, int64_t n, int64_t payload, int64_t count,
                          const uint32_t *stripes, uint32_t mark) {
    for (int64_t i = 0; i < n; i++) seal_one((uint8_t *)(uintptr_t)objects[i], payload, count, stripes + i * count, mark);
}

/*
 * A checked load's start: 1 when the object's trailer holds `mark` and its table's CRC-32C, then the table's
 * `count` CRCs go to expected[] and state[] is zeroed (lmcp_crc_check's); 0 when it does not, nothing written.
 */
static int open_one(const uint8_t *object, int64_t payload, int64_t count, uint32_t mark, uint32_t *expected,
                    uint32_t *state) {
    const uint8_t *table = object + payload, *trailer = table + 4 * count;
    if (load_le32(trailer + 4) != mark || load_le32(trailer) != lmcp_crc32c(table, 4 * count)) return 0;
    for (int64_t k = 0; k < count; k++) {
        expected[k] = load_le32(table + 4 * k);
        state[k] = LMCP_STRIPE_NEW;
    }
    return 1;
}

/*
 * open_one for each of the `n` objects at `objects` (`sizes` bytes each: one too short for its table and
 * trailer does not open), object i's expected CRCs then its states at room + 2 * count * i; opened[i] says
 * whether it opened.
 */
void lmcp_crc32c_open_all(const uint64_t *objects, const int64_t *sizes, int64_t n, int64_t payload, int64_t count,
                          uint32_t mark, uint32_t *room, uint8_t *opened) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t *expected = room + 2 * count * i;
        opened[i] = sizes[i] >= payload + 4 * count + LMCP_TRAILER_BYTES &&
                    open_one((const uint8_t *)(uintptr_t)objects[i], payload, count, mark, expected, expected + count);
    }
}

/* CRC-32C of data[0, n) with the table even where the instruction exists: tests compare the two. */
uint32_t lmcp_crc32c_portable(const uint8_t *data, int64_t n) {
    pthread_once(&table_once, build_tables);
    return ~crc_table(0xFFFFFFFFu, data, (size_t)n);
}

/* Whether the crc32 instruction is used (1) or the table (0). */
int lmcp_crc32c_hardware(void) { return have_hw(); }

/* The width of the carry-less fold in use: 512 (AVX-512 with VPCLMULQDQ), 256 (AVX2 with VPCLMULQDQ), 128
   (PCLMULQDQ), or 0 (none). */
int lmcp_crc32c_folding(void) {
    pthread_once(&table_once, build_tables);
    return fold_width();
}

/* Lets tests cap the fold's width (512, 256, 128, 0) to compare paths; returns the previous cap. */
int lmcp_crc32c_allow_vectors(int widest) { return atomic_exchange(&vectors_allowed, widest); }
