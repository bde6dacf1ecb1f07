#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "../../src/cpu/common/exp2.hpp"
#include "support.hpp"
#include "trisparse/core/dropout.hpp"

namespace trisparse {
namespace {

TEST(Numeric, EveryHalfRoundTripsThroughFloat) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = half_bits_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_bits_to_float(float_to_half_bits(f)))) << h;
      continue;
    }
    EXPECT_EQ(float_to_half_bits(f), h) << "half bits " << h;
  }
}

TEST(Numeric, VectorisableExp2IsWithinAnUlpOfLibm) {
  // Every 1/4096 step of [-126, 0], plus the ends and what lies below them.
  double worst = 0.0;
  for (int i = 0; i <= 126 * 4096; ++i) {
    const float x = -static_cast<float>(i) / 4096.0f;
    const double want = std::exp2(static_cast<double>(x));
    worst = std::max(worst, std::abs(cpu::exp2_nonpositive(x) - want) / want);
  }
  EXPECT_LE(worst, 2.0e-7);
  EXPECT_EQ(cpu::exp2_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(cpu::exp2_nonpositive(-1.0f), 0.5f);
  EXPECT_EQ(cpu::exp2_nonpositive(-127.0f), 0.0f);
  EXPECT_EQ(cpu::exp2_nonpositive(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isnan(cpu::exp2_nonpositive(std::numeric_limits<float>::quiet_NaN())));
}

TEST(Numeric, HalfRoundsToNearestEven) {
  EXPECT_EQ(half_bits_to_float(float_to_half_bits(1.0f + 1.0f / 2048)), 1.0f);  // tie -> even
  EXPECT_EQ(half_bits_to_float(float_to_half_bits(1.0f + 3.0f / 2048)), 1.0f + 4.0f / 2048);
  EXPECT_EQ(half_bits_to_float(float_to_half_bits(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(half_bits_to_float(float_to_half_bits(65520.0f))));  // rounds up to inf
  EXPECT_EQ(half_bits_to_float(float_to_half_bits(5.9604645e-08f)),
            5.9604645e-08f);  // smallest subnormal
  EXPECT_EQ(half_bits_to_float(float_to_half_bits(2.0e-8f)), 0.0f);
}

TEST(Numeric, Bf16RoundsToNearestEvenAndKeepsNan) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_bits_to_float(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_bf16_bits(f), b);
  }
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_TRUE(
      std::isnan(bf16_bits_to_float(float_to_bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Numeric, DtypeNamesRoundTrip) {
  for (const auto t : {dtype::f16, dtype::bf16, dtype::f32, dtype::f64})
    EXPECT_EQ(parse_dtype(to_string(t)), t);
  EXPECT_THROW(parse_dtype("int8"), invalid_input);
}

TEST(Numeric, RngIsDeterministicAndUniform) {
  rng a(7), b(7), c(8);
  double sum = 0;
  bool differs = false;
  for (int i = 0; i < 100000; ++i) {
    const double x = a.uniform();
    EXPECT_EQ(x, b.uniform());
    differs |= x != c.uniform();
    ASSERT_GE(x, 0.0);
    ASSERT_LT(x, 1.0);
    sum += x;
  }
  EXPECT_TRUE(differs);
  EXPECT_NEAR(sum / 100000, 0.5, 0.01);
  for (int i = 0; i < 1000; ++i) EXPECT_LT(a.below(7), 7u);
}

TEST(Tensor, CheckViewNamesTheArgument) {
  host_tensor t(dtype::f32, 4, 2, 8);
  EXPECT_NO_THROW(check_view(t.view(), "q", 4, 2, 8));
  try {
    check_view(t.view(), "q", 5, 2, 8);
    FAIL();
  } catch (const invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("q [4, 2, 8]"), std::string::npos) << e.what();
  }
  tensor_view overlapping = t.view();
  overlapping.row_stride = 8;
  EXPECT_THROW(check_view(overlapping, "k", -1, -1, -1), invalid_input);
}

TEST(Numeric, PhiloxGivesTheKnownAnswers) {
  // Philox4x32-10's published known-answer vectors (Random123, kat_vectors).
  const auto expect = [](philox::words w, std::uint32_t a, std::uint32_t b, std::uint32_t c,
                         std::uint32_t d) {
    EXPECT_EQ(w.x[0], a);
    EXPECT_EQ(w.x[1], b);
    EXPECT_EQ(w.x[2], c);
    EXPECT_EQ(w.x[3], d);
  };
  expect(philox::draw(0, 0, 0, 0, 0), 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u);
  const std::uint32_t ones = 0xffffffffu;
  expect(philox::draw(ones, ones, ones, ones, ~std::uint64_t{0}), 0x408f276du, 0x41c83b0eu,
         0xa20bc7c6u, 0x6d5451fdu);
  expect(philox::draw(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u,
                      (std::uint64_t{0x299f31d0u} << 32) | 0xa4093822u),
         0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u);
}

TEST(Numeric, DropoutKeepsOneMinusPAndScalesTheKept) {
  const attention_dropout d{0.3, nullptr};
  const double keep_scale = 1.0 / 0.7;
  std::int64_t kept = 0, total = 0;
  for (std::int64_t i = 0; i < 300; ++i)
    for (std::int64_t j = 0; j < 300; ++j)
      for (std::int32_t h = 0; h < 2; ++h, ++total) {
        const double f = dropout_factor(d, 12345, 6, i, j, h);
        ASSERT_TRUE(f == 0.0 || f == keep_scale) << f;
        kept += f > 0;
      }
  // 180,000 draws: the kept fraction within 5 standard deviations (0.0054) of 0.7.
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(total), 0.7, 0.0054);
  // Another seed or offset draws another mask.
  std::int64_t same = 0;
  for (std::int64_t i = 0; i < 100; ++i)
    same += dropout_factor(d, 12345, 6, i, 7, 0) == dropout_factor(d, 12345, 7, i, 7, 0);
  EXPECT_LT(same, 80);
  EXPECT_EQ(philox::drop_below(0.0), 0u);
  EXPECT_EQ(philox::drop_below16(0.0), 0u);
  EXPECT_EQ(dropout_factor({0.0, nullptr}, 1, 2, 3, 4, 0), 1.0);
  EXPECT_EQ(edge_dropout_factor({0.0, nullptr}, 1, 2, 3, 0), 1.0);
}

TEST(Numeric, DropoutDrawsOfOneCallAreIndependent) {
  // The eight 16-bit draws of a pair group (two keys' halves of four queries' words) and the four
  // heads of an edge's call: pairs drawn from one call are dropped together at rate p^2.
  const attention_dropout d{0.5, nullptr};
  std::int64_t both_keys = 0, both_queries = 0, pairs = 0;
  for (std::int64_t i = 0; i < 256; ++i)
    for (std::int64_t j = 0; j < 256; j += 2, ++pairs) {
      const bool a = dropout_factor(d, 99, 1, i, j, 3) == 0.0;
      both_keys += a && dropout_factor(d, 99, 1, i, j + 1, 3) == 0.0;
      both_queries += a && dropout_factor(d, 99, 1, i ^ 8, j, 3) == 0.0;
    }
  // 32,768 pairs: within 5 standard deviations (0.012) of 0.25.
  EXPECT_NEAR(static_cast<double>(both_keys) / static_cast<double>(pairs), 0.25, 0.012);
  EXPECT_NEAR(static_cast<double>(both_queries) / static_cast<double>(pairs), 0.25, 0.012);
  std::int64_t kept = 0, both_heads = 0, edges = 0;
  for (std::int64_t u = 0; u < 40000; ++u, ++edges) {
    const bool a = edge_dropout_factor(d, 7, 2, u, 4) == 0.0;
    kept += !a;
    both_heads += a && edge_dropout_factor(d, 7, 2, u, 5) == 0.0;
  }
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(edges), 0.5, 0.0125);
  EXPECT_NEAR(static_cast<double>(both_heads) / static_cast<double>(edges), 0.25, 0.011);
  // Edges past 2^32 draw their own words.
  std::int64_t same = 0;
  for (std::int64_t u = 0; u < 100; ++u)
    same += edge_dropout_factor(d, 7, 2, u, 0) ==
            edge_dropout_factor(d, 7, 2, u + (std::int64_t{1} << 32), 0);
  EXPECT_LT(same, 80);
}

}  // namespace
}  // namespace trisparse
