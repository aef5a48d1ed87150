/*
 * Compares crc32c.c's paths on the CPU it runs on (built for another one and run under an emulator by
 * test_crc32c_cross.py): whole buffers (the instruction, three thirds joined by shifting), stripes three at a
 * time, and pieces joined per stripe (fed last first), each against the table, over lengths and alignments;
 * shifts multiplied carry-lessly, then bit by bit (vectors capped at 0). Prints "hardware H check C
 * mismatches M".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint32_t lmcp_crc32c(const uint8_t *data, int64_t n);
uint32_t lmcp_crc32c_portable(const uint8_t *data, int64_t n);
int lmcp_crc32c_hardware(void);
void lmcp_crc32c_stripes(const uint8_t *data, int64_t n, int64_t stripe, int64_t first, int64_t last, uint32_t *out);
int lmcp_crc32c_accumulate(const uint8_t *data, int64_t n, int64_t offset, int64_t stripe, int64_t payload,
                           uint32_t *acc, int64_t *lens);
int lmcp_crc32c_finish(int64_t payload, int64_t stripe, const uint32_t *acc, const int64_t *lens, uint32_t *out);
int lmcp_crc32c_allow_vectors(int widest);

#define SIZE (3 * 20000 + 64)

static uint8_t data[SIZE];

/* How many of the paths' values differ from the table's. */
static long compare(void) {
    long mismatches = 0;
    for (int64_t n = 0; n <= 9000; n += n < 64 ? 1 : 37) {
        for (int align = 0; align < 8; align++) {
            mismatches += lmcp_crc32c(data + align, n) != lmcp_crc32c_portable(data + align, n);
        }
    }
    const int64_t stripes[] = {1, 7, 64, 1000, 4096, 20000};
    for (size_t s = 0; s < sizeof stripes / sizeof *stripes; s++) {
        const int64_t stripe = stripes[s], n = 3 * stripe + stripe / 2 + 1, count = (n + stripe - 1) / stripe;
        uint32_t got[8], acc[8] = {0}, joined[8];
        int64_t lens[8] = {0};
        lmcp_crc32c_stripes(data + 3, n, stripe, 0, count, got);
        int64_t cut[32], pieces = 0; /* pieces of growing length, fed last first */
        for (int64_t at = 0, piece = 1; at < n; at += piece, piece = piece * 3 + 1) cut[pieces++] = at;
        cut[pieces] = n;
        for (int64_t p = pieces - 1; p >= 0; p--)
            mismatches += lmcp_crc32c_accumulate(data + 3 + cut[p], cut[p + 1] - cut[p], cut[p], stripe, n, acc,
                                                 lens) != 0;
        mismatches += lmcp_crc32c_finish(n, stripe, acc, lens, joined) != 0;
        for (int64_t k = 0; k < count; k++) {
            const int64_t len = n - k * stripe < stripe ? n - k * stripe : stripe;
            const uint32_t want = lmcp_crc32c_portable(data + 3 + k * stripe, len);
            mismatches += (got[k] != want) + (joined[k] != want);
        }
    }
    return mismatches;
}

int main(void) {
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < SIZE; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        data[i] = (uint8_t)x;
    }
    long mismatches = compare(); /* shifts multiply carry-lessly (PMULL) */
    lmcp_crc32c_allow_vectors(0);
    mismatches += compare(); /* bit by bit */
    printf("hardware %d check %08x mismatches %ld\n", lmcp_crc32c_hardware(),
           lmcp_crc32c((const uint8_t *)"123456789", 9), mismatches);
    return 0;
}
