// Aligned text tables for the `refit` CLI and the benchmarks; not part of the library's API.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace refit {

/// A text table with a header row, auto-sized columns and right-aligned numbers, as printed by
/// every per-step table of the CLI:
///
///     step  tensor        changed      wire
///     ----  ------------  -------  --------
///        1  embed.weight    1.20%  1.50 MiB
///
/// A column is right-aligned when every non-empty cell in it (other than "-", which marks a
/// missing value) starts like a number: an optional sign, then a digit or '.' followed by a digit.
/// Widths count bytes, so cells should be ASCII. Columns are separated by two spaces and
/// trailing spaces are trimmed.
///
/// Thread-safety: a value type; concurrent const calls are safe, mutation needs exclusion.
class Table {
 public:
  explicit Table(std::vector<std::string> headers) : headers_(std::move(headers)) {}

  /// Append a row. A shorter row is padded with empty cells; a longer one adds columns with
  /// empty headers.
  void AddRow(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }

  size_t num_rows() const { return rows_.size(); }

  /// Print the header, a dashed rule and every row, each line ending in '\n'.
  void Print(std::ostream& out) const;
  /// Return what Print() prints.
  std::string ToString() const;

 private:
  std::vector<std::string> headers_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace refit
