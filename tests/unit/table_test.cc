#include "table.h"

#include <gtest/gtest.h>

namespace refit {
namespace {

TEST(TableTest, ExactLayout) {
  Table table({"step", "tensor", "changed", "wire"});
  table.AddRow({"1", "model.embed_tokens.weight", "1.20%", "1.50 MiB"});
  table.AddRow({"12", "lm_head.weight", "0.05%", "310 KiB"});
  table.AddRow({"-", "model.norm.weight", "-", "-"});
  EXPECT_EQ(table.num_rows(), 3u);
  EXPECT_EQ(table.ToString(),
            "step  tensor                     changed      wire\n"
            "----  -------------------------  -------  --------\n"
            "   1  model.embed_tokens.weight    1.20%  1.50 MiB\n"
            "  12  lm_head.weight               0.05%   310 KiB\n"
            "   -  model.norm.weight                -         -\n");
}

TEST(TableTest, RaggedRowsAndMixedColumns) {
  Table table({"name", "value"});
  table.AddRow({"a"});
  table.AddRow({"bb", "n/a", "extra"});
  table.AddRow({"ccc", "-7"});
  std::ostringstream out;
  table.Print(out);
  // "value" mixes text and a number, so it stays left-aligned; the extra column has no header.
  EXPECT_EQ(out.str(),
            "name  value\n"
            "----  -----  -----\n"
            "a\n"
            "bb    n/a    extra\n"
            "ccc   -7\n");
}

TEST(TableTest, HeaderOnly) { EXPECT_EQ(Table({"a", "bc"}).ToString(), "a  bc\n-  --\n"); }

}  // namespace
}  // namespace refit
