// The CPU's fp32 arithmetic peak: AVX2 fused multiply-adds with no memory traffic.
// Ten independent accumulator chains per thread hide the FMA latency, so the loop runs at the
// issue rate (2 FMAs of 8 floats per cycle on Zen 3); best of 5 trials.
//
//   gcc -O2 -mavx2 -mfma -fopenmp benchmarks/fma_peak.c -o /tmp/fma_peak
//   OMP_NUM_THREADS=2 /tmp/fma_peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#define CHAINS 10
#define STEPS 20000000L  // loop iterations per thread, CHAINS FMAs each

int main(void) {
    double best = 0.0;
    for (int trial = 0; trial < 5; trial++) {
        float sink = 0.0f;
        double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
        {
            __m256 acc[CHAINS];
            const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
            for (int j = 0; j < CHAINS; j++) acc[j] = _mm256_set1_ps(1.0f);
            for (long i = 0; i < STEPS; i++) {
#pragma GCC unroll 10  // all chains in registers: one vfmadd per chain per iteration
                for (int j = 0; j < CHAINS; j++) acc[j] = _mm256_fmadd_ps(acc[j], b, c);
            }
            float lanes[8];
            for (int j = 1; j < CHAINS; j++) acc[0] = _mm256_add_ps(acc[0], acc[j]);
            _mm256_storeu_ps(lanes, acc[0]);
            sink += lanes[0];  // keeps the loop from being optimised away
        }
        double dt = omp_get_wtime() - t0;
        double flops = 2.0 * 8 * CHAINS * STEPS * omp_get_max_threads();
        if (flops / dt > best) best = flops / dt;
        printf("trial %d: %.1f GFLOP/s (sink %.3f)\n", trial, flops / dt / 1e9, sink);
    }
    printf("%d threads: best %.1f GFLOP/s\n", omp_get_max_threads(), best / 1e9);
    return 0;
}
