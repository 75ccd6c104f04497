// The OTLP/JSON text of a run of copy-event spans, from the event table's Arrow columns (Python
// only: no torch header). copytrace.export.columnar.span_texts builds the same text with Arrow's
// string kernels (about 5.4 µs of CPU per event); here each row's span is written in one pass
// into one bytes object (no copy at the end), with the GIL released (the traced thread runs
// meanwhile). An attribute whose value equals that of the last span of the same name is copied
// from that span's text, a run of such attributes in one copy, instead of being written again
// (spans of one op share most of their about 30 attributes). The text is byte
// for byte the Python encoders' (copytrace.export.otlp_json.Encoder, tests/test_export_columnar.py
// compares them): strings escaped as json.dumps does by default (ensure_ascii: DEL and non-ASCII
// as \uXXXX, lowercase hex, surrogate pairs beyond the BMP), ints in decimal.
//
// An array is handed over as (kind, length, offset, validity, buffer 1, buffer 2, child offset,
// child buffer 1, child buffer 2): Arrow's layout (pyarrow.Array.buffers()), kinds as in
// columns.cpp (0 int64, 1 bool, 2 string, 3 list<int64>, 4 list<string>); buffers are any
// objects with the buffer protocol (pyarrow.Buffer), or None.
#include <Python.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <string>
#include <vector>

#include "observer.h"

namespace copytrace {
namespace {

enum Kind { K_INT = 0, K_BOOL = 1, K_STR = 2, K_INT_LIST = 3, K_STR_LIST = 4 };

// Buffer views held for the call (released by the destructor, with the GIL held).
struct Views {
  std::vector<Py_buffer> held;
  ~Views() {
    for (Py_buffer& v : held) PyBuffer_Release(&v);
  }
  // The bytes of `obj` (None: nullptr); false with an error set.
  bool get(PyObject* obj, const uint8_t** out) {
    *out = nullptr;
    if (obj == Py_None) return true;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) != 0) return false;
    held.push_back(view);
    *out = static_cast<const uint8_t*>(view.buf);
    return true;
  }
};

struct Array {
  int kind = 0;
  Py_ssize_t offset = 0;
  const uint8_t* valid = nullptr;
  const uint8_t* buf1 = nullptr;  // int64 / bool bits / int32 offsets
  const uint8_t* buf2 = nullptr;  // string data
  Py_ssize_t child_offset = 0;
  const uint8_t* child1 = nullptr;  // list child: int64 values / int32 offsets
  const uint8_t* child2 = nullptr;  // list child: string data
  std::string head;                 // an attribute's {"key":"...","value":

  bool is_valid(Py_ssize_t i) const {
    if (valid == nullptr) return true;
    const Py_ssize_t j = offset + i;
    return (valid[j >> 3] >> (j & 7)) & 1;
  }
};

inline int32_t i32(const uint8_t* p, Py_ssize_t i) {
  int32_t v;
  std::memcpy(&v, p + 4 * i, 4);
  return v;
}

inline int64_t i64(const uint8_t* p, Py_ssize_t i) {
  int64_t v;
  std::memcpy(&v, p + 8 * i, 8);
  return v;
}

// Parse (kind, length, offset, validity, b1, b2, child offset, c1, c2).
bool parse(PyObject* spec, Views& views, Array* a) {
  PyObject *valid, *b1, *b2, *c1, *c2;
  Py_ssize_t length = 0;
  if (!PyArg_ParseTuple(spec, "innOOOnOO", &a->kind, &length, &a->offset, &valid, &b1, &b2,
                        &a->child_offset, &c1, &c2)) {
    return false;
  }
  return views.get(valid, &a->valid) && views.get(b1, &a->buf1) && views.get(b2, &a->buf2) &&
         views.get(c1, &a->child1) && views.get(c2, &a->child2);
}

// The spans' text, written straight into a bytes object (no final copy): over-allocated, grown
// (with the GIL taken back for the resize) when a row would overflow it, shrunk at the end.
// After a failed resize (MemoryError set) every append is dropped and take() returns nullptr.
class Out {
 public:
  explicit Out(size_t cap) : cap_(cap) {
    bytes_ = PyBytes_FromStringAndSize(nullptr, (Py_ssize_t)cap);
    data_ = bytes_ != nullptr ? PyBytes_AS_STRING(bytes_) : nullptr;
    if (bytes_ == nullptr) cap_ = 0;
  }
  ~Out() { Py_XDECREF(bytes_); }
  bool ok() const { return bytes_ != nullptr; }
  Out(const Out&) = delete;
  Out& operator=(const Out&) = delete;
  // While the GIL is released: where the released thread state is kept.
  void released(PyThreadState** save) { save_ = save; }
  size_t size() const { return len_; }
  void append(const char* s, size_t k) {
    if (len_ + k > cap_ && !grow(k)) return;
    std::memcpy(data_ + len_, s, k);
    len_ += k;
  }
  void append(const char* s) { append(s, std::strlen(s)); }
  void append(const std::string& s) { append(s.data(), s.size()); }
  void push_back(char c) {
    if (len_ + 1 > cap_ && !grow(1)) return;
    data_[len_++] = c;
  }
  // Append k bytes of this text from offset `from` (before the end).
  void repeat(size_t from, size_t k) {
    if (len_ + k > cap_ && !grow(k)) return;
    std::memcpy(data_ + len_, data_ + from, k);
    len_ += k;
  }
  // The bytes object, its size the text's (the GIL held); nullptr with an error set.
  PyObject* take() {
    if (bytes_ == nullptr) return nullptr;
    if (_PyBytes_Resize(&bytes_, (Py_ssize_t)len_) != 0) return nullptr;
    PyObject* out = bytes_;
    bytes_ = nullptr;
    return out;
  }

 private:
  bool grow(size_t k) {
    if (bytes_ == nullptr) return false;
    const size_t want = std::max(cap_ * 2, len_ + k + 65536);
    if (save_ != nullptr) PyEval_RestoreThread(*save_);
    const bool ok = _PyBytes_Resize(&bytes_, (Py_ssize_t)want) == 0;  // bytes_ NULL on failure
    if (save_ != nullptr) *save_ = PyEval_SaveThread();
    if (!ok) {
      cap_ = len_ = 0;
      data_ = nullptr;
      return false;
    }
    data_ = PyBytes_AS_STRING(bytes_);
    cap_ = want;
    return true;
  }
  PyObject* bytes_ = nullptr;
  char* data_ = nullptr;
  size_t len_ = 0, cap_ = 0;
  PyThreadState** save_ = nullptr;
};

const char kHex[] = "0123456789abcdef";

void put_u(Out& out, unsigned cp) {
  char esc[6] = {'\\', 'u', kHex[(cp >> 12) & 15], kHex[(cp >> 8) & 15], kHex[(cp >> 4) & 15],
                 kHex[cp & 15]};
  out.append(esc, 6);
}

// `s` (UTF-8, n bytes) as a JSON string, as json.dumps writes it (ensure_ascii).
void put_json(Out& out, const uint8_t* s, Py_ssize_t n) {
  out.push_back('"');
  Py_ssize_t i = 0;
  while (i < n) {
    unsigned c = s[i];
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      Py_ssize_t j = i + 1;  // a run of printable ASCII (json.dumps escapes DEL too)
      while (j < n && s[j] >= 0x20 && s[j] < 0x7f && s[j] != '"' && s[j] != '\\') ++j;
      out.append(reinterpret_cast<const char*>(s + i), (size_t)(j - i));
      i = j;
      continue;
    }
    if (c < 0x80) {
      switch (c) {
        case '"': out.append("\\\""); break;
        case '\\': out.append("\\\\"); break;
        case '\n': out.append("\\n"); break;
        case '\r': out.append("\\r"); break;
        case '\t': out.append("\\t"); break;
        case '\b': out.append("\\b"); break;
        case '\f': out.append("\\f"); break;
        default: put_u(out, c);
      }
      ++i;
      continue;
    }
    unsigned cp;
    int len;
    if (c >= 0xf0) {
      cp = c & 0x07, len = 4;
    } else if (c >= 0xe0) {
      cp = c & 0x0f, len = 3;
    } else {
      cp = c & 0x1f, len = 2;
    }
    for (int k = 1; k < len && i + k < n; ++k) cp = (cp << 6) | (s[i + k] & 0x3f);
    i += len;
    if (cp >= 0x10000) {
      cp -= 0x10000;
      put_u(out, 0xd800 + (cp >> 10));
      put_u(out, 0xdc00 + (cp & 0x3ff));
    } else {
      put_u(out, cp);
    }
  }
  out.push_back('"');
}

inline void put_int(Out& out, int64_t v) {
  char digits[24];
  auto res = std::to_chars(digits, digits + sizeof digits, v);
  out.append(digits, (size_t)(res.ptr - digits));
}

inline void put_str_value(Out& out, const uint8_t* offs, const uint8_t* data,
                          Py_ssize_t j) {
  const int32_t a = i32(offs, j), b = i32(offs, j + 1);
  out.append("{\"stringValue\":");
  put_json(out, data + a, b - a);
  out.push_back('}');
}

// The AnyValue of row i of `a` (valid).
void put_value(Out& out, const Array& a, Py_ssize_t i) {
  const Py_ssize_t j = a.offset + i;
  switch (a.kind) {
    case K_INT:
      out.append("{\"intValue\":\"");
      put_int(out, i64(a.buf1, j));
      out.append("\"}");
      return;
    case K_BOOL:
      out.append((a.buf1[j >> 3] >> (j & 7)) & 1 ? "{\"boolValue\":true}"
                                                  : "{\"boolValue\":false}");
      return;
    case K_STR:
      put_str_value(out, a.buf1, a.buf2, j);
      return;
    default: {
      out.append("{\"arrayValue\":{\"values\":[");
      const int32_t lo = i32(a.buf1, j), hi = i32(a.buf1, j + 1);
      for (int32_t k = lo; k < hi; ++k) {
        if (k != lo) out.push_back(',');
        const Py_ssize_t c = a.child_offset + k;
        if (a.kind == K_INT_LIST) {
          out.append("{\"intValue\":\"");
          put_int(out, i64(a.child1, c));
          out.append("\"}");
        } else {
          put_str_value(out, a.child1, a.child2, c);
        }
      }
      out.append("]}}");
    }
  }
}

inline void put_cell(Out& out, const Array& a, Py_ssize_t i) {
  const Py_ssize_t j = a.offset + i;
  const int32_t lo = i32(a.buf1, j), hi = i32(a.buf1, j + 1);
  out.append(reinterpret_cast<const char*>(a.buf2 + lo), (size_t)(hi - lo));
}

inline bool same_str(const uint8_t* offs, const uint8_t* data, Py_ssize_t r, Py_ssize_t i) {
  const int32_t ra = i32(offs, r), rb = i32(offs, r + 1), ia = i32(offs, i), ib = i32(offs, i + 1);
  return rb - ra == ib - ia && std::memcmp(data + ra, data + ia, (size_t)(rb - ra)) == 0;
}

// Rows r and i of `a` (both valid) hold the same value.
bool same_value(const Array& a, Py_ssize_t r, Py_ssize_t i) {
  const Py_ssize_t jr = a.offset + r, ji = a.offset + i;
  switch (a.kind) {
    case K_INT: return i64(a.buf1, jr) == i64(a.buf1, ji);
    case K_BOOL: return ((a.buf1[jr >> 3] >> (jr & 7)) & 1) == ((a.buf1[ji >> 3] >> (ji & 7)) & 1);
    case K_STR: return same_str(a.buf1, a.buf2, jr, ji);
    default: {
      const int32_t rlo = i32(a.buf1, jr), rhi = i32(a.buf1, jr + 1);
      const int32_t ilo = i32(a.buf1, ji), ihi = i32(a.buf1, ji + 1);
      if (rhi - rlo != ihi - ilo) return false;
      if (a.kind == K_INT_LIST) {
        return std::memcmp(a.child1 + 8 * (a.child_offset + rlo),
                           a.child1 + 8 * (a.child_offset + ilo), 8 * (size_t)(rhi - rlo)) == 0;
      }
      for (int32_t k = 0; k < rhi - rlo; ++k) {
        if (!same_str(a.child1, a.child2, a.child_offset + rlo + k, a.child_offset + ilo + k))
          return false;
      }
      return true;
    }
  }
}

// The last row written of one span name, and where each of its attributes' text
// ({"key":...,"value":...}) is in the output (start -1: not written).
struct Ref {
  const uint8_t* name = nullptr;
  int32_t name_len = 0;
  Py_ssize_t row = -1;
  std::vector<int64_t> start, end;
};

// The attributes of row i: an attribute whose value equals that of `ref`'s row (the last row
// of the same span name) is copied from that row's text, consecutive ones in one copy (the
// comma between them with them); the others are written. `start`/`end` get where each
// attribute's text is in the output (start -1 where it is left out).
void put_attributes(Out& out, const std::vector<Array>& attrs, Py_ssize_t i, const Ref* ref,
                    std::vector<int64_t>& start, std::vector<int64_t>& end,
                    std::vector<size_t>& run) {
  const bool has_ref = ref != nullptr && ref->row >= 0;
  bool first = true;
  int64_t from = -1, to = -1;  // a pending copy of the ref row's text [from, to)
  auto copy = [&]() {
    if (from < 0) return;
    const int64_t at = (int64_t)out.size();
    out.repeat((size_t)from, (size_t)(to - from));
    for (size_t k : run) {
      start[k] = at + (ref->start[k] - from);
      end[k] = at + (ref->end[k] - from);
    }
    run.clear();
    from = -1;
  };
  for (size_t k = 0; k < attrs.size(); ++k) {
    const Array& a = attrs[k];
    if (!a.is_valid(i)) {
      start[k] = -1;
      continue;
    }
    const bool same = has_ref && ref->start[k] >= 0 && same_value(a, ref->row, i);
    if (same && from >= 0 && ref->start[k] == to + 1) {  // next to the pending copy's last
      to = ref->end[k];
      run.push_back(k);
      continue;
    }
    copy();
    out.append(first ? ",\"attributes\":[" : ",");
    first = false;
    if (same) {
      from = ref->start[k];
      to = ref->end[k];
      run.push_back(k);
      continue;
    }
    start[k] = (int64_t)out.size();
    out.append(a.head);
    put_value(out, a, i);
    out.push_back('}');
    end[k] = (int64_t)out.size();
  }
  copy();
  if (!first) out.push_back(']');
}

// The Ref of the span name at row i of `names` (a new one while there are fewer than kRefs
// names; nullptr beyond).
constexpr size_t kRefs = 64;
Ref* ref_of(std::vector<Ref>& refs, const Array& names, Py_ssize_t i, size_t n_attrs) {
  const Py_ssize_t j = names.offset + i;
  const int32_t lo = i32(names.buf1, j), hi = i32(names.buf1, j + 1);
  const uint8_t* name = names.buf2 + lo;
  for (Ref& r : refs) {
    if (r.name_len == hi - lo && std::memcmp(r.name, name, (size_t)(hi - lo)) == 0) return &r;
  }
  if (refs.size() >= kRefs) return nullptr;
  refs.emplace_back();
  Ref& r = refs.back();
  r.name = name;
  r.name_len = hi - lo;
  r.start.assign(n_attrs, -1);
  r.end.assign(n_attrs, -1);
  return &r;
}

// attrs: a sequence of (head, array spec), see span_json; false with an error set.
bool parse_attrs(PyObject* attrs, Views& views, std::vector<Array>* out) {
  PyObject* seq = PySequence_Fast(attrs, "span_json: attrs must be a sequence");
  if (seq == nullptr) return false;
  out->resize((size_t)PySequence_Fast_GET_SIZE(seq));
  for (size_t k = 0; k < out->size(); ++k) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, (Py_ssize_t)k);
    PyObject *head, *spec;
    const char* text = nullptr;
    Py_ssize_t len = 0;
    if (!PyArg_ParseTuple(item, "OO", &head, &spec) ||
        (text = PyUnicode_AsUTF8AndSize(head, &len)) == nullptr ||
        !parse(spec, views, &(*out)[k])) {
      Py_DECREF(seq);
      return false;
    }
    (*out)[k].head.assign(text, (size_t)len);
  }
  Py_DECREF(seq);
  return true;
}

}  // namespace

// span_json(n, trace, ids, parents, names, starts, ends, attrs, error) -> (text, offsets):
// trace a str (hex); ids, parents, names string arrays, starts, ends int64 arrays (ns since
// the epoch), attrs a sequence of (head, array) in the order the spans write them (head: the
// attribute's '{"key":"...","value":' text; null cells are left out), error a string array
// (the span's status message where not null) or None. Returns the spans' text, each followed
// by ",", and the int64 offsets of the n texts (n + 1 values).
PyObject* py_span_json(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "span_json takes 9 arguments");
    return nullptr;
  }
  Py_ssize_t n = PyLong_AsSsize_t(argv[0]);
  Py_ssize_t trace_len = 0;
  const char* trace = PyUnicode_AsUTF8AndSize(argv[1], &trace_len);
  if ((n < 0 && PyErr_Occurred()) || trace == nullptr) return nullptr;
  Views views;
  Array ids, parents, names, starts, ends, error;
  if (!parse(argv[2], views, &ids) || !parse(argv[3], views, &parents) ||
      !parse(argv[4], views, &names) || !parse(argv[5], views, &starts) ||
      !parse(argv[6], views, &ends)) {
    return nullptr;
  }
  const bool has_error = argv[8] != Py_None;
  if (has_error && !parse(argv[8], views, &error)) return nullptr;
  std::vector<Array> attrs;
  if (!parse_attrs(argv[7], views, &attrs)) return nullptr;
  std::vector<int64_t> offsets((size_t)n + 1, 0);
  const std::string lead = std::string("{\"traceId\":\"") + std::string(trace, (size_t)trace_len) +
                           "\",\"spanId\":\"";
  Out out((size_t)n * 2048 + 65536);  // address space: pages are touched as they are written
  if (!out.ok()) return nullptr;
  std::vector<Ref> refs;
  refs.reserve(kRefs);  // no reallocation: Ref pointers stay valid
  std::vector<int64_t> start(attrs.size(), -1), end(attrs.size(), -1);
  std::vector<size_t> run;
  run.reserve(attrs.size());
  PyThreadState* save = PyEval_SaveThread();
  out.released(&save);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out.append(lead);
    put_cell(out, ids, i);
    out.append("\",\"parentSpanId\":\"");
    put_cell(out, parents, i);
    out.append("\",\"name\":");
    {
      const Py_ssize_t j = names.offset + i;
      const int32_t lo = i32(names.buf1, j), hi = i32(names.buf1, j + 1);
      put_json(out, names.buf2 + lo, hi - lo);
    }
    out.append(",\"kind\":1,\"startTimeUnixNano\":\"");
    put_int(out, i64(starts.buf1, starts.offset + i));
    out.append("\",\"endTimeUnixNano\":\"");
    put_int(out, i64(ends.buf1, ends.offset + i));
    out.push_back('"');
    Ref* ref = ref_of(refs, names, i, attrs.size());
    put_attributes(out, attrs, i, ref, start, end, run);
    if (ref != nullptr) {  // this row is its name's reference now
      ref->row = i;
      ref->start.swap(start);
      ref->end.swap(end);
    }
    if (has_error && error.is_valid(i)) {
      const Py_ssize_t j = error.offset + i;
      const int32_t lo = i32(error.buf1, j), hi = i32(error.buf1, j + 1);
      out.append(",\"status\":{\"code\":2,\"message\":");
      put_json(out, error.buf2 + lo, hi - lo);
      out.push_back('}');
    }
    out.append("},");
    offsets[(size_t)i + 1] = (int64_t)out.size();
  }
  out.released(nullptr);
  PyEval_RestoreThread(save);
  PyObject* text = out.take();
  if (text == nullptr) return nullptr;
  return Py_BuildValue("(NN)", text,
                       PyBytes_FromStringAndSize(reinterpret_cast<const char*>(offsets.data()),
                                                 (Py_ssize_t)(offsets.size() * 8)));
}

}  // namespace copytrace
