/* Generated from lmcache_platforms/kernels/plane_table.py by scripts/gen_plane_table_header.py;
 * do not edit (tests/kernels/test_plane_table_schema.py checks it is current). */
#ifndef LMCP_PLANE_TABLE_H
#define LMCP_PLANE_TABLE_H

#include <stdint.h>

#define LMCP_ABI_VERSION 2
#define LMCP_PLANE_FIELDS 9

/* Offset of each field in one int64 table row. */
#define LMCP_F_BASE 0
#define LMCP_F_BLOCK_STRIDE 1
#define LMCP_F_ROWS_PER_BLOCK 2
#define LMCP_F_ROW_STRIDE 3
#define LMCP_F_SEGMENTS 4
#define LMCP_F_SEGMENT_BYTES 5
#define LMCP_F_SEGMENT_STRIDE 6
#define LMCP_F_ROW_BYTES 7
#define LMCP_F_BUFFER_PREFIX 8

typedef struct {
    int64_t base; /* address of block 0, row 0, segment 0 */
    int64_t block_stride; /* bytes */
    int64_t rows_per_block;
    int64_t row_stride; /* bytes */
    int64_t segments;
    int64_t segment_bytes;
    int64_t segment_stride; /* bytes */
    int64_t row_bytes; /* segments * segment_bytes */
    int64_t buffer_prefix; /* row bytes of the planes before this one: its rows start at prefix * rows */
} lmcp_plane;

#endif
