/*
 * CRC-32C (Castagnoli; reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF) of the
 * stripes of a buffer: the checksum of every chunk object lmcache_platforms stores (connector/checksum.py).
 *
 * x86-64 with SSE4.2 uses the crc32 instruction on three stripes at once: one stream is bound by the
 * instruction's 3-cycle latency, three independent ones keep its unit busy every cycle. Elsewhere a table
 * (eight bytes per step) gives the same values, slower. Called from several Python threads at once (ctypes
 * releases the GIL); it keeps no state but the table, built once.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

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

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
    }
    for (; n; n--, p++) c = _mm_crc32_u8((uint32_t)c, *p);
    return (uint32_t)c;
}

/* Three stripes of `n` bytes each, interleaved; results (not inverted) into out[0..2]. */
__attribute__((target("sse4.2"))) static void crc_hw3(const uint8_t *a, const uint8_t *b, const uint8_t *c,
                                                       size_t n, uint32_t out[3]) {
    uint64_t ca = 0xFFFFFFFFu, cb = 0xFFFFFFFFu, cc = 0xFFFFFFFFu;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t wa, wb, wc;
        memcpy(&wa, a + i, 8);
        memcpy(&wb, b + i, 8);
        memcpy(&wc, c + i, 8);
        ca = _mm_crc32_u64(ca, wa);
        cb = _mm_crc32_u64(cb, wb);
        cc = _mm_crc32_u64(cc, wc);
    }
    out[0] = crc_hw((uint32_t)ca, a + i, n - i);
    out[1] = crc_hw((uint32_t)cb, b + i, n - i);
    out[2] = crc_hw((uint32_t)cc, c + i, n - i);
}

static int have_hw(void) { return __builtin_cpu_supports("sse4.2"); }
#else
static int have_hw(void) { return 0; }
#endif

static uint32_t crc_any(uint32_t crc, const uint8_t *p, size_t n) {
#if defined(__x86_64__)
    if (have_hw()) return crc_hw(crc, p, n);
#endif
    return crc_table(crc, p, n);
}

/* CRC-32C of data[0, n). */
uint32_t lmcp_crc32c(const uint8_t *data, int64_t n) {
    pthread_once(&table_once, build_table);
    return ~crc_any(0xFFFFFFFFu, data, (size_t)n);
}

/*
 * CRC-32C of stripes first..last-1 of data[0, n) cut into `stripe`-byte pieces (the last may be shorter),
 * into out[0 .. last-first).
 */
void lmcp_crc32c_stripes(const uint8_t *data, int64_t n, int64_t stripe, int64_t first, int64_t last,
                         uint32_t *out) {
    pthread_once(&table_once, build_table);
    int64_t k = first;
#if defined(__x86_64__)
    if (have_hw()) {
        for (; k + 3 <= last && (k + 3) * stripe <= n; k += 3) {
            uint32_t three[3];
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

/* CRC-32C of data[0, n) with the table even where the instruction exists: tests compare the two. */
uint32_t lmcp_crc32c_portable(const uint8_t *data, int64_t n) {
    pthread_once(&table_once, build_table);
    return ~crc_table(0xFFFFFFFFu, data, (size_t)n);
}

/* Whether the crc32 instruction is used (1) or the table (0). */
int lmcp_crc32c_hardware(void) { return have_hw(); }
