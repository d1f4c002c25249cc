// Kernels for decoding on a CPU, built with the system's C++ compiler on first use and called through ctypes
// (mars/cpu_kernels.py), in one of two builds:
// - AVX-512 BF16: mars_int4_mm, y = x W^T + b for int4 weights, the kernel of `--quantize int4`
//   (mars/quantize.py), and mars_lowrank_add, a gated adapter's low-rank update at a decode step's mask rows
//   (mars/adapter.py);
// - AVX2 with FMA (CPUs without AVX-512 BF16): mars_int4_mm alone, in float32 (at the end of this file).
//
// mars_int4_mm. Why a kernel of our own: torch's int4 CPU kernel turns every weight into a float32 and multiplies in
// float32, once per block of 4 rows, so a forward of a few positions (a verify step) costs much more than
// one of a single position. Here the 4-bit codes become bf16 numbers, exactly (q - 8 is in [-8, 7]), and
// vdpbf16ps multiplies two inputs per lane per instruction; a group's scale and zero apply once per 32
// inputs, by factoring them out of the group's sum:
//
//   W[n, k] = (q[n, k] - 8) s[g, n] + z[g, n]   for k in group g (32 inputs)
//   y[m, n] = sum_g  s[g, n] * sum_{k in g} a[m, k] (q[n, k] - 8)  +  z[g, n] * sum_{k in g} a[m, k]
//
// a is x rounded to bf16 (x itself when the model runs in bf16). Every product a (q - 8) is exact in
// float32 (vdpbf16ps flushes denormals to zero); the sums run in float32. (The AVX2 build: below.) A row's result takes the same
// instructions in the same order whatever the other rows are, so a forward of n positions gives each
// position what a forward of it alone gives: the property exact self-verification needs (docs/method.md §9).
//
// The packed weights (pack_int4 in mars/cpu_kernels.py): for each block of 32 output channels, for each group
// of 32 inputs, 640 bytes:
//   s[32] bf16 | z[32] bf16 | 16 input pairs x 32 bytes of codes
// In input pair p, byte j holds channel j / 2's code for input 2p + j % 2 in its low nibble, and channel
// 16 + j / 2's in its high nibble: widened to 16 bits, the low nibbles are the (input, input + 1) pairs of
// channels 0-15 in the order vdpbf16ps takes them, the high nibbles those of channels 16-31.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {
constexpr int COLS = 32, GROUP = 32, PAIRS = GROUP / 2, GROUP_BYTES = 4 * COLS + PAIRS * COLS;

// mars_int4_mm of either build: x (M, K), float32 or bf16 (x_bf16) -> y (M, N) in the same dtype; w packed for
// N rounded up to 32; bias (N,) float32 or null. K is a multiple of 32; threads: torch's. Returns 0, or -1 when
// out of memory. The build (Isa) gives: A, the type of its copy of x; prepare, which writes that copy (a) and
// each group's sum of it; RB, the rows a block takes at most; block, bm <= RB rows of a against 32 channels;
// store_row, one row of a block's float32 result (plus bias) in y's dtype.
template <class Isa>
int int4_mm(const void* x, int x_bf16, const uint8_t* w, const float* bias, void* y, int M, int N, int K,
            int threads) {
  const int G = K / GROUP, blocks = (N + COLS - 1) / COLS;
  typename Isa::A* a = (typename Isa::A*)malloc(sizeof(typename Isa::A) * M * K);
  float* sums = (float*)malloc(sizeof(float) * M * G);
  if (!a || !sums) {
    free(a);
    free(sums);
    return -1;
  }
  Isa::prepare(x, x_bf16, a, sums, M, K);
  const int size = x_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int nb = 0; nb < blocks; nb++) {
    float out[Isa::RB * COLS];
    const uint8_t* wb = w + (long)nb * G * GROUP_BYTES;
    const int cols = N - nb * COLS < COLS ? N - nb * COLS : COLS;
    for (int m0 = 0; m0 < M; m0 += Isa::RB) {
      const int bm = M - m0 < Isa::RB ? M - m0 : Isa::RB;
      Isa::block(bm, a + (long)m0 * K, sums + (long)m0 * G, wb, K, out);
      for (int m = 0; m < bm; m++)
        Isa::store_row(out + m * COLS, bias ? bias + nb * COLS : nullptr, cols, x_bf16,
                       (char*)y + ((long)(m0 + m) * N + nb * COLS) * size);
    }
  }
  free(a);
  free(sums);
  return 0;
}

}  // namespace

#if defined(__AVX512BF16__)
namespace {

__m512 bf16x16_to_float(const void* p) {
  __m256i v = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// BM rows (1 to 4) of x against one block of 32 channels -> out (BM, 32) float32.
template <int BM>
void block(const uint16_t* a, const float* sums, const uint8_t* w, int K, float* out) {
  const int G = K / GROUP;
  // q -> q - 8 as bf16 (index q of 16; vpermw reads 5 bits, so the table is written twice)
  const __m512i table = _mm512_set_epi16(
      0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
      -0x4080, -0x4000, -0x3fc0, -0x3f80, -0x3f60, -0x3f40, -0x3f20, -0x3f00,
      0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
      -0x4080, -0x4000, -0x3fc0, -0x3f80, -0x3f60, -0x3f40, -0x3f20, -0x3f00);
  const __m512i low_nibble = _mm512_set1_epi16(0x0f);
  __m512 y[BM][2];
  for (int m = 0; m < BM; m++) y[m][0] = y[m][1] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++, w += GROUP_BYTES) {
    const __m512 s0 = bf16x16_to_float(w), s1 = bf16x16_to_float(w + 32);
    const __m512 z0 = bf16x16_to_float(w + 64), z1 = bf16x16_to_float(w + 96);
    const uint8_t* codes = w + 128;
    __m512 dot[BM][2];  // sum over the group of a (q - 8), channels 0-15 and 16-31
    for (int m = 0; m < BM; m++) dot[m][0] = dot[m][1] = _mm512_setzero_ps();
    for (int p = 0; p < PAIRS; p++) {
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(codes + p * COLS)));
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, low_nibble), table);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
      for (int m = 0; m < BM; m++) {
        int32_t pair;  // a[m, 2p] and a[m, 2p + 1] of the group
        memcpy(&pair, a + (long)m * K + g * GROUP + 2 * p, sizeof pair);
        const __m512bh ab = (__m512bh)_mm512_set1_epi32(pair);
        dot[m][0] = _mm512_dpbf16_ps(dot[m][0], ab, lo);
        dot[m][1] = _mm512_dpbf16_ps(dot[m][1], ab, hi);
      }
    }
    for (int m = 0; m < BM; m++) {
      const __m512 sum = _mm512_set1_ps(sums[m * G + g]);
      y[m][0] = _mm512_fmadd_ps(dot[m][0], s0, _mm512_fmadd_ps(z0, sum, y[m][0]));
      y[m][1] = _mm512_fmadd_ps(dot[m][1], s1, _mm512_fmadd_ps(z1, sum, y[m][1]));
    }
  }
  for (int m = 0; m < BM; m++) {
    _mm512_storeu_ps(out + m * COLS, y[m][0]);
    _mm512_storeu_ps(out + m * COLS + 16, y[m][1]);
  }
}

void store_row(const float* out, const float* bias, int cols, bool bf16, void* y) {
  float row[COLS];
  for (int j = 0; j < cols; j++) row[j] = out[j] + (bias ? bias[j] : 0.0f);
  if (!bf16) {
    for (int j = 0; j < cols; j++) ((float*)y)[j] = row[j];
    return;
  }
  for (int j = cols; j < COLS; j++) row[j] = 0.0f;
  uint16_t packed[COLS];
  _mm256_storeu_si256((__m256i*)packed, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row)));
  _mm256_storeu_si256((__m256i*)(packed + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + 16)));
  for (int j = 0; j < cols; j++) ((uint16_t*)y)[j] = packed[j];
}

struct Avx512Bf16 {
  using A = uint16_t;  // x rounded to bf16
  static constexpr int RB = 4;
  static void prepare(const void* x, int x_bf16, uint16_t* a, float* sums, int M, int K) {
    for (long i = 0; i < (long)M * K; i += 16) {  // a = bf16(x), rounded to nearest even
      const __m512 v = x_bf16 ? bf16x16_to_float((const uint16_t*)x + i) : _mm512_loadu_ps((const float*)x + i);
      _mm256_storeu_si256((__m256i*)(a + i), (__m256i)_mm512_cvtneps_pbh(v));
    }
    for (long i = 0; i < (long)M * (K / GROUP); i++)  // each group's sum of a, in one fixed order
      sums[i] = _mm512_reduce_add_ps(
          _mm512_add_ps(bf16x16_to_float(a + i * GROUP), bf16x16_to_float(a + i * GROUP + 16)));
  }
  static void block(int bm, const uint16_t* a, const float* sums, const uint8_t* w, int K, float* out) {
    switch (bm) {
      case 4: ::block<4>(a, sums, w, K, out); break;
      case 3: ::block<3>(a, sums, w, K, out); break;
      case 2: ::block<2>(a, sums, w, K, out); break;
      default: ::block<1>(a, sums, w, K, out); break;
    }
  }
  static void store_row(const float* out, const float* bias, int cols, bool bf16, void* y) {
    ::store_row(out, bias, cols, bf16, y);
  }
};

}  // namespace

extern "C" int mars_int4_mm(const void* x, int x_bf16, const uint8_t* w, const float* bias, void* y, int M,
                            int N, int K, int threads) {
  return int4_mm<Avx512Bf16>(x, x_bf16, w, bias, y, M, N, K, threads);
}

// y[m] += (A x[m]) B^T gate[m] at the rows m whose gate is not 0; the other rows of y are not touched, so a
// clean position keeps the base model's bits (docs/method.md §10). The gated adapter's update of one linear
// at a decode step, in place of its float32 matmuls, about 200 a forward, each with a fixed cost that
// dominates at a few rows. x (M, K), A (r, K), Bt (r, N) (B transposed), y (M, N): bf16; gate (M,) float32, the
// adapter's scale at the masks. K is a multiple of 32; threads: torch's. Returns 0, or -1 when out of memory.
extern "C" int mars_lowrank_add(const uint16_t* x, const uint16_t* A, const uint16_t* Bt, const float* gate,
                                uint16_t* y, int M, int K, int N, int r, int threads) {
  int* rows = (int*)malloc(sizeof(int) * M);
  float* u = (float*)malloc(sizeof(float) * M * r);
  if (!rows || !u) {
    free(rows);
    free(u);
    return -1;
  }
  int R = 0;
  for (int m = 0; m < M; m++)
    if (gate[m] != 0.0f) rows[R++] = m;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int j = 0; j < r; j++) {  // u[i, j] = gate * (A x)[j], for the gated rows i
    for (int i = 0; i < R; i++) {
      const uint16_t* xm = x + (long)rows[i] * K;
      __m512 dot = _mm512_setzero_ps();
      for (int k = 0; k < K; k += 32)
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(A + (long)j * K + k),
                               (__m512bh)_mm512_loadu_si512(xm + k));
      u[i * r + j] = _mm512_reduce_add_ps(dot) * gate[rows[i]];
    }
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int n0 = 0; n0 < N; n0 += 16) {  // y[m, n] += sum_j u[i, j] B[n, j], 16 channels at a time
    const __mmask16 keep = N - n0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1);
    for (int i = 0; i < R; i++) {
      __m512 delta = _mm512_setzero_ps();
      for (int j = 0; j < r; j++) {
        const __m256i b = _mm256_maskz_loadu_epi16(keep, Bt + (long)j * N + n0);
        delta = _mm512_fmadd_ps(_mm512_set1_ps(u[i * r + j]),
                                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)), delta);
      }
      uint16_t* ym = y + (long)rows[i] * N + n0;
      const __m256i old = _mm256_maskz_loadu_epi16(keep, ym);
      const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)), delta);
      _mm256_mask_storeu_epi16(ym, keep, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
  free(rows);
  free(u);
  return 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
// mars_int4_mm on AVX2: the same packed bytes and the same factoring, in float32 (a is x in float32). A byte of
// input pair p widens to a lane per (channel, input parity): 8 lanes hold channels 4i..4i+3 for inputs 2p and
// 2p + 1, and multiply (a[2p], a[2p + 1]) repeated; the two parities of a channel are added once, at the end.
// q - 8 is exact in float32, each product is rounded by its FMA, and a row's instructions and their order
// depend on that row alone, as above. 16 ymm registers: a block takes 2 rows and 16 channels at a time.
namespace {

__m256 bf16x8(const void* p) {  // 8 bf16 -> 8 float32, exactly
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

__m256 bf16x4_twice(const void* p) {  // bf16 s0..s3 -> s0 s0 s1 s1 s2 s2 s3 s3 in float32
  const __m128i v = _mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i*)p)), 16);
  return _mm256_castsi256_ps(
      _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(v), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
}

// BM rows (1 or 2) of a against one block of 32 channels -> out (BM, 32) float32.
template <int BM>
void block(const float* a, const float* sums, const uint8_t* w, int K, float* out) {
  const int G = K / GROUP;
  const __m256i nibble = _mm256_set1_epi8(0x0f), eight = _mm256_set1_epi8(8);
  alignas(32) float y[BM][2 * COLS], yz[BM][COLS];  // per (channel, parity): the scaled sums; per channel: zeros
  for (int m = 0; m < BM; m++) {
    for (int i = 0; i < 2 * COLS; i++) y[m][i] = 0.0f;
    for (int i = 0; i < COLS; i++) yz[m][i] = 0.0f;
  }
  for (int g = 0; g < G; g++, w += GROUP_BYTES) {
    const uint8_t* codes = w + 128;
    for (int h = 0; h < 2; h++) {  // channels 0-15 (low nibbles), then 16-31 (high nibbles)
      __m256 dot[BM][4];
      for (int m = 0; m < BM; m++)
        for (int i = 0; i < 4; i++) dot[m][i] = _mm256_setzero_ps();
      for (int p = 0; p < PAIRS; p++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(codes + p * COLS));
        v = _mm256_sub_epi8(_mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, nibble), eight);  // q - 8
        const __m128i v0 = _mm256_castsi256_si128(v), v1 = _mm256_extracti128_si256(v, 1);
        const __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0)),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8))),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1)),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)))};
        for (int m = 0; m < BM; m++) {
          const double* ap = (const double*)(a + (long)m * K + g * GROUP + 2 * p);  // a[2p], a[2p + 1]
          const __m256 pair = _mm256_castpd_ps(_mm256_broadcast_sd(ap));
          for (int i = 0; i < 4; i++) dot[m][i] = _mm256_fmadd_ps(q[i], pair, dot[m][i]);
        }
      }
      for (int i = 0; i < 4; i++) {
        const __m256 scale = bf16x4_twice(w + 8 * (4 * h + i));
        for (int m = 0; m < BM; m++) {
          float* yi = y[m] + 8 * (4 * h + i);
          _mm256_store_ps(yi, _mm256_fmadd_ps(dot[m][i], scale, _mm256_load_ps(yi)));
        }
      }
    }
    for (int i = 0; i < 4; i++) {
      const __m256 zero = bf16x8(w + 64 + 16 * i);
      for (int m = 0; m < BM; m++) {
        float* yi = yz[m] + 8 * i;
        _mm256_store_ps(yi, _mm256_fmadd_ps(zero, _mm256_set1_ps(sums[m * G + g]), _mm256_load_ps(yi)));
      }
    }
  }
  for (int m = 0; m < BM; m++)
    for (int c = 0; c < COLS; c++) out[m * COLS + c] = (y[m][2 * c] + y[m][2 * c + 1]) + yz[m][c];
}

uint16_t to_bf16(float f) {  // round to nearest even; a NaN stays a NaN
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct Avx2 {
  using A = float;  // x in float32
  static constexpr int RB = 2;
  static void prepare(const void* x, int x_bf16, float* a, float* sums, int M, int K) {
    for (long i = 0; i < (long)M * K; i += 8)
      _mm256_storeu_ps(a + i, x_bf16 ? bf16x8((const uint16_t*)x + i) : _mm256_loadu_ps((const float*)x + i));
    for (long i = 0; i < (long)M * (K / GROUP); i++) {  // each group's sum of a, in one fixed order
      const float* p = a + i * GROUP;
      alignas(32) float t[8];
      _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                       _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24))));
      sums[i] = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
    }
  }
  static void block(int bm, const float* a, const float* sums, const uint8_t* w, int K, float* out) {
    if (bm == 2)
      ::block<2>(a, sums, w, K, out);
    else
      ::block<1>(a, sums, w, K, out);
  }
  static void store_row(const float* out, const float* bias, int cols, bool bf16, void* y) {
    for (int j = 0; j < cols; j++) {
      const float v = out[j] + (bias ? bias[j] : 0.0f);
      if (bf16)
        ((uint16_t*)y)[j] = to_bf16(v);
      else
        ((float*)y)[j] = v;
    }
  }
};

}  // namespace

// As the AVX-512 BF16 build's: the same arguments, layout and return value.
extern "C" int mars_int4_mm(const void* x, int x_bf16, const uint8_t* w, const float* bias, void* y, int M,
                            int N, int K, int threads) {
  return int4_mm<Avx2>(x, x_bf16, w, bias, y, M, N, K, threads);
}
#endif
