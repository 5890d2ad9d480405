/* The sampler's greedy choice on the CPU: each row's first maximal index, as torch's max(dim=-1).indices
 * answers it. PyTorch's reduction took ~30 us a row of SmolLM2's 49k vocabulary (~0.5 ms for the 17 rows of
 * a speculative verify step, 5 % of the step); one pass of vector compares takes a few. */

#include "cpu_kernels_common.h"

#define CHAINS 4 /* independent compare chains: one alone waits on its compare and blend every 8 floats */
#define SPAN (8 * CHAINS)

/* The first index of the row's maximum; a NaN is above every number (torch's rule), so the first NaN wins. */
static int64_t row_argmax(const float *x, int64_t n) {
    int64_t i = 0, best_i = 0;
    float best = x[0];
    int has_nan = 0;
    if (n >= SPAN) {
        /* lane l of chain c keeps its own first maximum among indices = 8c + l (mod SPAN): a strict > never
         * moves a tie, and across lanes the smaller index wins a tie */
        v8f lane_max[CHAINS];
        v8i lane_at[CHAINS], at[CHAINS], nan = {0};
        const v8i step = {SPAN, SPAN, SPAN, SPAN, SPAN, SPAN, SPAN, SPAN};
        for (int c = 0; c < CHAINS; c++) {
            lane_max[c] = *(const v8f *)(x + 8 * c);
            for (int l = 0; l < 8; l++) lane_at[c][l] = 8 * c + l;
            at[c] = lane_at[c];
            nan |= (v8i)(lane_max[c] != lane_max[c]);
        }
        for (i = SPAN; i + SPAN <= n; i += SPAN)
            for (int c = 0; c < CHAINS; c++) {
                const v8f v = *(const v8f *)(x + i + 8 * c);
                at[c] += step;
                const v8i above = (v8i)(v > lane_max[c]);
                lane_max[c] = v8f_select(above, v, lane_max[c]);
                lane_at[c] = (lane_at[c] & ~above) | (at[c] & above);
                nan |= (v8i)(v != v);
            }
        for (int l = 0; l < 8; l++) has_nan |= nan[l] != 0;
        for (int c = 0; c < CHAINS; c++)
            for (int l = 0; l < 8; l++)
                if (lane_max[c][l] > best || (lane_max[c][l] == best && lane_at[c][l] < best_i)) {
                    best = lane_max[c][l];
                    best_i = lane_at[c][l];
                }
    } else {
        has_nan = x[0] != x[0];
        i = 1;
    }
    for (; i < n; i++) { /* the tail: later indices than every lane's, so a tie keeps the earlier one */
        has_nan |= x[i] != x[i];
        if (x[i] > best) {
            best = x[i];
            best_i = i;
        }
    }
    if (has_nan)
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    return best_i;
}

/* x [rows, n] (row stride x_stride, n >= 1) -> out [rows]: each row's first maximal index. */
void srt_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t x_stride, int64_t *out) {
#pragma omp parallel for if (rows * n >= 262144) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * x_stride, n);
}
