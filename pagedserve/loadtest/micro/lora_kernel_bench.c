/* The fused layer's LoRA delta alone (kernels/csrc/fused_lora.h lora_add), at the default model's
 * shapes (SmolLM2-135M: 30 layers of qkv 576->960 in 3 sections, o 576->576, gate/up 576->3072 in 2,
 * down 1536->576), 4 adapter slots, rows round-robin over them: the LoRA cost of one decode step with
 * the step's base GEMVs left out. Every layer has its own slots, so the adapter weights stream from
 * memory as in a real step (65 MB a c=16 step at rank 16 in fp32). Thread CPU time of the calling
 * thread (CLOCK_THREAD_CPUTIME_ID) and wall time, min / mean of ITERS steps.
 *
 * Why a C harness: the box this was tuned on is shared, wall clock moves 5-30x between runs; one
 * thread's CPU time on a fixed workload does not (loadtest/PERF.md, "LoRA overhead, thirteenth session").
 *
 *   gcc -O3 -std=c11 -fopenmp -ffp-contract=off -mavx2 -mfma -Ikernels/csrc \
 *       loadtest/micro/lora_kernel_bench.c -o /tmp/lora_kernel_bench -lm
 *   /tmp/lora_kernel_bench RANK ROWS THREADS ITERS [WEIGHTS: 0 fp32, 1 bf16] [LAYERS] */
#include "fused_cpu.c"

#include <stdio.h>
#include <time.h>

static double now(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float uniform(void) { return rand() / (float)RAND_MAX - 0.5f; }

typedef struct {
    int64_t K, N, S, cols[4];
} shape;

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s RANK ROWS THREADS ITERS [WEIGHTS 0|1] [LAYERS]\n", argv[0]);
        return 2;
    }
    const int R = atoi(argv[1]), M = atoi(argv[2]), nth = atoi(argv[3]), iters = atoi(argv[4]);
    const int bf16 = argc > 5 && atoi(argv[5]) == 1, layers = argc > 6 ? atoi(argv[6]) : 30, slots = 4;
    const shape shapes[4] = {{576, 960, 3, {0, 576, 768, 960}}, {576, 576, 1, {0, 576, 576, 576}},
                             {576, 3072, 2, {0, 1536, 3072, 3072}}, {1536, 576, 1, {0, 576, 576, 576}}};
    if (M < 1 || M > 16 || layers < 1) return 2;
    fz_linear(*lin)[4] = calloc((size_t)layers, sizeof *lin);
    srand(1);
    for (int l = 0; l < layers; l++)
        for (int j = 0; j < 4; j++) {
            const shape s = shapes[j];
            const int64_t W = R * s.S, na = slots * W * s.K, nb = slots * W * s.N;
            float *a = malloc((size_t)na * 4), *b = calloc((size_t)nb, 4);
            for (int64_t i = 0; i < na; i++) a[i] = uniform() * 0.04f;
            for (int sl = 0; sl < slots; sl++) /* block-diagonal B, as gpu/models/lora_layers.py lays it out */
                for (int sec = 0; sec < s.S; sec++)
                    for (int r = 0; r < R; r++)
                        for (int64_t c = s.cols[sec]; c < s.cols[sec + 1]; c++)
                            b[((size_t)sl * W + sec * R + r) * s.N + c] = uniform() * 0.04f;
            fz_linear *L = &lin[l][j];
            L->lora_a = a;
            L->lora_b = b;
            if (bf16) {
                uint16_t *a2 = malloc((size_t)na * 2), *b2 = malloc((size_t)nb * 2);
                for (int64_t i = 0; i < na; i++) a2[i] = f32_to_bf16(a[i]);
                for (int64_t i = 0; i < nb; i++) b2[i] = f32_to_bf16(b[i]);
                free(a);
                free(b);
                L->lora_a = a2;
                L->lora_b = b2;
            }
            L->lora_rank = R;
            L->lora_sections = s.S;
            L->lora_dtype = bf16;
            for (int i = 0; i < 4; i++) L->lora_col[i] = s.cols[i < s.S ? i : s.S];
        }
    int32_t rows[16];
    for (int m = 0; m < M; m++) rows[m] = m % slots;
    float *x = malloc(16 * 3072 * 4), *y = calloc(16 * 3072, 4);
    for (int i = 0; i < 16 * 3072; i++) x[i] = uniform();
    double best = 1e9, sum = 0, best_wall = 1e9;
    for (int it = 0; it < iters; it++) {
        double t0 = now(CLOCK_THREAD_CPUTIME_ID), w0 = now(CLOCK_MONOTONIC);
        for (int l = 0; l < layers; l++)
            for (int j = 0; j < 4; j++)
                if (lora_add(&lin[l][j], x, M, shapes[j].K, shapes[j].N, y, rows, nth, 0)) return 1;
        double t = now(CLOCK_THREAD_CPUTIME_ID) - t0, w = now(CLOCK_MONOTONIC) - w0;
        best = t < best ? t : best;
        best_wall = w < best_wall ? w : best_wall;
        sum += t;
    }
    printf("rank %d, %d rows, %d threads, %s weights, %d layers: thread CPU min %.3f ms mean %.3f ms, wall min %.3f ms\n",
           R, M, nth, bf16 ? "bf16" : "fp32", layers, best * 1e3, sum / iters * 1e3, best_wall * 1e3);
    return 0;
}
