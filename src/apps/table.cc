#include "table.h"

#include <algorithm>
#include <sstream>
#include <string_view>

namespace refit {
namespace {

// Whether `cell` starts like a number: optional sign, then a digit or '.' and a digit.
bool LooksNumeric(std::string_view cell) {
  auto is_digit = [](char c) { return c >= '0' && c <= '9'; };
  if (!cell.empty() && (cell.front() == '-' || cell.front() == '+')) cell.remove_prefix(1);
  if (cell.empty()) return false;
  if (is_digit(cell.front())) return true;
  return cell.size() >= 2 && cell[0] == '.' && is_digit(cell[1]);
}

}  // namespace

void Table::Print(std::ostream& out) const {
  size_t columns = headers_.size();
  for (const std::vector<std::string>& row : rows_) columns = std::max(columns, row.size());
  auto cell = [](const std::vector<std::string>& row, size_t column) -> std::string_view {
    return column < row.size() ? std::string_view(row[column]) : std::string_view();
  };

  std::vector<size_t> widths(columns, 0);
  std::vector<bool> right_aligned(columns, false);
  for (size_t c = 0; c < columns; ++c) {
    widths[c] = cell(headers_, c).size();
    bool any_number = false;
    bool all_numbers = true;
    for (const std::vector<std::string>& row : rows_) {
      const std::string_view value = cell(row, c);
      widths[c] = std::max(widths[c], value.size());
      if (value.empty() || value == "-") continue;
      const bool number = LooksNumeric(value);
      any_number |= number;
      all_numbers &= number;
    }
    right_aligned[c] = any_number && all_numbers;
  }

  auto print_line = [&](auto&& cell_at) {
    std::string line;
    for (size_t c = 0; c < columns; ++c) {
      const std::string_view value = cell_at(c);
      const std::string padding(widths[c] - value.size(), ' ');
      if (c > 0) line += "  ";
      if (right_aligned[c]) line += padding;
      line += value;
      if (!right_aligned[c]) line += padding;
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out << line << '\n';
  };
  print_line([&](size_t c) { return cell(headers_, c); });
  std::vector<std::string> rule(columns);
  for (size_t c = 0; c < columns; ++c) rule[c].assign(widths[c], '-');
  print_line([&](size_t c) { return std::string_view(rule[c]); });
  for (const std::vector<std::string>& row : rows_) {
    print_line([&](size_t c) { return cell(row, c); });
  }
}

std::string Table::ToString() const {
  std::ostringstream out;
  Print(out);
  return out.str();
}

}  // namespace refit
