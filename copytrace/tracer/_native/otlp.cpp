// The OTLP/JSON text of a run of copy-event spans, from the event table's Arrow columns (Python
// only: no torch header). copytrace.export.columnar.span_texts builds the same text with Arrow's
// string kernels (about 5.4 µs of CPU per event); here each row's span is written in one pass
// into one buffer, with the GIL released (the traced thread runs meanwhile). The text is byte
// for byte the Python encoders' (copytrace.export.otlp_json.Encoder, tests/test_export_columnar.py
// compares them): strings escaped as json.dumps does by default (ensure_ascii: DEL and non-ASCII
// as \uXXXX, lowercase hex, surrogate pairs beyond the BMP), ints in decimal.
//
// An array is handed over as (kind, length, offset, validity, buffer 1, buffer 2, child offset,
// child buffer 1, child buffer 2): Arrow's layout (pyarrow.Array.buffers()), kinds as in
// columns.cpp (0 int64, 1 bool, 2 string, 3 list<int64>, 4 list<string>); buffers are any
// objects with the buffer protocol (pyarrow.Buffer), or None.
#include <Python.h>

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

const char kHex[] = "0123456789abcdef";

void put_u(std::string& out, unsigned cp) {
  char esc[6] = {'\\', 'u', kHex[(cp >> 12) & 15], kHex[(cp >> 8) & 15], kHex[(cp >> 4) & 15],
                 kHex[cp & 15]};
  out.append(esc, 6);
}

// `s` (UTF-8, n bytes) as a JSON string, as json.dumps writes it (ensure_ascii).
void put_json(std::string& out, const uint8_t* s, Py_ssize_t n) {
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

inline void put_int(std::string& out, int64_t v) {
  char digits[24];
  auto res = std::to_chars(digits, digits + sizeof digits, v);
  out.append(digits, (size_t)(res.ptr - digits));
}

inline void put_str_value(std::string& out, const uint8_t* offs, const uint8_t* data,
                          Py_ssize_t j) {
  const int32_t a = i32(offs, j), b = i32(offs, j + 1);
  out.append("{\"stringValue\":");
  put_json(out, data + a, b - a);
  out.push_back('}');
}

// The AnyValue of row i of `a` (valid).
void put_value(std::string& out, const Array& a, Py_ssize_t i) {
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

inline void put_cell(std::string& out, const Array& a, Py_ssize_t i) {
  const Py_ssize_t j = a.offset + i;
  const int32_t lo = i32(a.buf1, j), hi = i32(a.buf1, j + 1);
  out.append(reinterpret_cast<const char*>(a.buf2 + lo), (size_t)(hi - lo));
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
  PyObject* seq = PySequence_Fast(argv[7], "span_json: attrs must be a sequence");
  if (seq == nullptr) return nullptr;
  std::vector<Array> attrs((size_t)PySequence_Fast_GET_SIZE(seq));
  for (size_t k = 0; k < attrs.size(); ++k) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, (Py_ssize_t)k);
    PyObject *head, *spec;
    const char* text = nullptr;
    Py_ssize_t len = 0;
    if (!PyArg_ParseTuple(item, "OO", &head, &spec) ||
        (text = PyUnicode_AsUTF8AndSize(head, &len)) == nullptr ||
        !parse(spec, views, &attrs[k])) {
      Py_DECREF(seq);
      return nullptr;
    }
    attrs[k].head.assign(text, (size_t)len);
  }
  Py_DECREF(seq);
  std::string out;
  std::vector<int64_t> offsets((size_t)n + 1, 0);
  const std::string lead = std::string("{\"traceId\":\"") + std::string(trace, (size_t)trace_len) +
                           "\",\"spanId\":\"";
  Py_BEGIN_ALLOW_THREADS;
  out.reserve((size_t)n * 1024);
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
    bool first = true;
    for (const Array& a : attrs) {
      if (!a.is_valid(i)) continue;
      out.append(first ? ",\"attributes\":[" : ",");
      first = false;
      out.append(a.head);
      put_value(out, a, i);
      out.push_back('}');
    }
    if (!first) out.push_back(']');
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
  Py_END_ALLOW_THREADS;
  return Py_BuildValue("(NN)", PyBytes_FromStringAndSize(out.data(), (Py_ssize_t)out.size()),
                       PyBytes_FromStringAndSize(reinterpret_cast<const char*>(offsets.data()),
                                                 (Py_ssize_t)(offsets.size() * 8)));
}

}  // namespace copytrace
