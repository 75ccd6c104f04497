// A run of event records as Arrow column buffers, in one pass over the records in C (Python only: no
// torch header). The export thread's file sink turns a flush's CopyEvent records into the event
// table's columns (copytrace.export.columnar.event_columns); reading 45 fields of each record
// with operator.attrgetter, checking their types and converting the lists with pyarrow cost
// about 12 µs per event there (cProfile, 99,000 events). Here each field of each record is read
// from its slot (the class's __slots__ offsets, found once per call), a record's fields one
// after the other while it is in the cache (a pass per field took 1.5 µs per event), and
// written straight into
// the buffers Arrow's layout takes (pyarrow.Array.from_buffers): validity bitmaps (LSB first,
// 1 = valid), int64 values, bit-packed bools, int32 offsets and UTF-8 data.
//
// Only values the column holds as the trace file's reader reads them are taken: an exact int
// within int64, an exact bool, an exact str (encodable as UTF-8), a list or tuple of those, or
// None. Any other value (a bool in an int field, a str subclass, an int beyond int64, an unset
// slot) makes the call return None: the caller then encodes the run one event at a time.
#include <Python.h>
#include <structmember.h>

#include <cstring>
#include <string>
#include <vector>

#include "observer.h"

namespace copytrace {
namespace {

enum Kind { K_INT = 0, K_BOOL = 1, K_STR = 2, K_INT_LIST = 3, K_STR_LIST = 4 };

// Growable byte buffer with typed appends (std::string keeps its bytes contiguous).
struct Buf {
  std::string bytes;
  template <typename T>
  void put(T value) {
    bytes.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  PyObject* take() { return PyBytes_FromStringAndSize(bytes.data(), (Py_ssize_t)bytes.size()); }
};

// A bitmap of n bits, all 0.
struct Bits {
  std::string bytes;
  explicit Bits(Py_ssize_t n) : bytes((size_t)((n + 7) / 8), '\0') {}
  void set(Py_ssize_t i) { bytes[(size_t)(i >> 3)] |= (char)(1u << (i & 7)); }
  PyObject* take() { return PyBytes_FromStringAndSize(bytes.data(), (Py_ssize_t)bytes.size()); }
};

// The slot offset of `name` in `type` (a class with __slots__), or -1.
Py_ssize_t slot_offset(PyTypeObject* type, const char* name) {
  for (PyTypeObject* t = type; t != nullptr; t = t->tp_base) {
    if (t->tp_members == nullptr) continue;
    for (PyMemberDef* m = t->tp_members; m->name != nullptr; ++m) {
      if (m->type == T_OBJECT_EX && std::strcmp(m->name, name) == 0) return m->offset;
    }
  }
  return -1;
}

inline PyObject* slot(PyObject* ev, Py_ssize_t off) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(ev) + off);
}

// Append v (an exact int in int64) to out; false otherwise.
inline bool put_int(Buf& out, PyObject* v) {
  if (!PyLong_CheckExact(v)) return false;
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow != 0 || (x == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  out.put<int64_t>((int64_t)x);
  return true;
}

// Append v (an exact str) to data and its end to offsets; false otherwise.
inline bool put_str(Buf& offsets, std::string& data, PyObject* v) {
  if (!PyUnicode_CheckExact(v)) return false;
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(v, &size);
  if (utf8 == nullptr) {  // lone surrogates: the per-event path writes them
    PyErr_Clear();
    return false;
  }
  data.append(utf8, (size_t)size);
  if (data.size() > 0x7fffffffu) return false;  // int32 offsets
  offsets.put<int32_t>((int32_t)data.size());
  return true;
}

inline PyObject* bytes_of(const std::string& text) {
  return PyBytes_FromStringAndSize(text.data(), (Py_ssize_t)text.size());
}

// The last offset written (offsets always hold at least the leading 0).
inline int32_t last(const Buf& offsets) {
  int32_t end = 0;
  std::memcpy(&end, offsets.bytes.data() + offsets.bytes.size() - 4, 4);
  return end;
}

// One field's column, built a row at a time (see py_event_columns for its buffers).
class Column {
 public:
  Column(Py_ssize_t n, Py_ssize_t off, int kind, bool keep_empty)
      : off_(off), kind_(kind), keep_empty_(keep_empty), valid_(n), bools_(kind == K_BOOL ? n : 0) {
    if (kind == K_INT || kind == K_INT_LIST) data_.bytes.reserve((size_t)n * 8);
    if (kind != K_INT && kind != K_BOOL) {
      offsets_.bytes.reserve((size_t)n * 4 + 4);
      offsets_.put<int32_t>(0);
    }
    if (kind == K_STR_LIST) child_offsets_.put<int32_t>(0);
  }

  // Row i from event `ev`; false when its value does not fit the column.
  bool add(PyObject* ev, Py_ssize_t i) {
    PyObject* v = slot(ev, off_);
    if (v == nullptr) return false;  // an unset slot
    const int kind = kind_;
    bool is_list = PyList_CheckExact(v);
    bool empty_null = (kind == K_INT_LIST || kind == K_STR_LIST) && !is_list &&
                      PyTuple_CheckExact(v) && PyTuple_GET_SIZE(v) == 0;
    if (v == Py_None || empty_null ||
        (is_list && PyList_GET_SIZE(v) == 0 && !keep_empty_)) {  // null: left out
      ++nulls_;
      if (kind == K_INT) data_.put<int64_t>(0);
      if (kind != K_INT && kind != K_BOOL) offsets_.put<int32_t>(last(offsets_));
      return true;
    }
    valid_.set(i);
    switch (kind) {
      case K_INT:
        return put_int(data_, v);
      case K_BOOL:
        if (v == Py_True) {
          bools_.set(i);
          return true;
        }
        return v == Py_False;
      case K_STR:
        return put_str(offsets_, text_, v);
      default: {  // a list or tuple of exact ints / strs
        if (!is_list && !PyTuple_CheckExact(v)) return false;
        Py_ssize_t m = PySequence_Fast_GET_SIZE(v);
        PyObject** items = PySequence_Fast_ITEMS(v);
        for (Py_ssize_t j = 0; j < m; ++j) {
          bool ok = kind == K_INT_LIST ? put_int(data_, items[j])
                                       : put_str(child_offsets_, text_, items[j]);
          if (!ok) return false;
        }
        Py_ssize_t count = kind == K_INT_LIST ? (Py_ssize_t)(data_.bytes.size() / 8)
                                              : (Py_ssize_t)(child_offsets_.bytes.size() / 4 - 1);
        if (count > 0x7fffffff) return false;
        offsets_.put<int32_t>((int32_t)count);
        return true;
      }
    }
  }

  // The column's tuple of buffers; null with an error set on failure.
  PyObject* take() {
    PyObject* validity = nulls_ != 0 ? valid_.take() : (Py_INCREF(Py_None), Py_None);
    if (validity == nullptr) return nullptr;
    switch (kind_) {
      case K_INT:
        return Py_BuildValue("(nNN)", nulls_, validity, data_.take());
      case K_BOOL:
        return Py_BuildValue("(nNN)", nulls_, validity, bools_.take());
      case K_STR:
        return Py_BuildValue("(nNNN)", nulls_, validity, offsets_.take(), bytes_of(text_));
      case K_INT_LIST:
        return Py_BuildValue("(nNNN)", nulls_, validity, offsets_.take(), data_.take());
      default:
        return Py_BuildValue("(nNNNN)", nulls_, validity, offsets_.take(), child_offsets_.take(),
                             bytes_of(text_));
    }
  }

 private:
  Py_ssize_t off_;
  int kind_;
  bool keep_empty_;
  Bits valid_;
  Py_ssize_t nulls_ = 0;
  Buf data_, offsets_, child_offsets_;
  std::string text_;
  Bits bools_;
};

}  // namespace

// event_columns(events, specs): events, a list of records of one class with __slots__;
// specs, a sequence of (field name, kind, keep_empty): kind 0 int, 1 bool, 2 str, 3 int list,
// 4 str list; keep_empty (lists) keeps an empty list as an empty cell (an empty tuple, and
// without keep_empty any empty list, is null). Returns one tuple per spec,
//   int:      (nulls, validity, int64 values)
//   bool:     (nulls, validity, value bits)
//   str:      (nulls, validity, int32 offsets, UTF-8 data)
//   int list: (nulls, validity, int32 offsets, int64 values)
//   str list: (nulls, validity, int32 offsets, int32 value offsets, UTF-8 data)
// validity None when no cell is null (a null cell's int is 0); or None when a value does not
// fit its column (see the file's head). TypeError for arguments of the wrong shape.
PyObject* py_event_columns(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_CheckExact(argv[0])) {
    PyErr_SetString(PyExc_TypeError, "event_columns(events: list, specs)");
    return nullptr;
  }
  PyObject* events = argv[0];
  Py_ssize_t n = PyList_GET_SIZE(events);
  PyObject** evs = PySequence_Fast_ITEMS(events);
  PyTypeObject* type = n != 0 ? Py_TYPE(evs[0]) : nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (Py_TYPE(evs[i]) != type) Py_RETURN_NONE;
  }
  PyObject* specs = PySequence_Fast(argv[1], "event_columns: specs must be a sequence");
  if (specs == nullptr) return nullptr;
  Py_ssize_t count = PySequence_Fast_GET_SIZE(specs);
  std::vector<Column> cols;
  cols.reserve((size_t)count);
  bool fits = true;
  for (Py_ssize_t k = 0; k < count; ++k) {
    const char* name = nullptr;
    int kind = 0, keep = 0;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(specs, k), "sip", &name, &kind, &keep) ||
        kind < K_INT || kind > K_STR_LIST) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "event_columns: a bad kind");
      Py_DECREF(specs);
      return nullptr;
    }
    Py_ssize_t off = type != nullptr ? slot_offset(type, name) : 0;
    if (off < 0) fits = false;
    cols.emplace_back(n, off, kind, keep != 0);
  }
  Py_DECREF(specs);
  // a row at a time: each record is read once, all its fields while it is in the cache
  for (Py_ssize_t i = 0; fits && i < n; ++i) {
    for (Column& col : cols) {
      if (!col.add(evs[i], i)) {
        fits = false;
        break;
      }
    }
  }
  if (!fits) Py_RETURN_NONE;
  PyObject* out = PyList_New(count);
  for (Py_ssize_t k = 0; out != nullptr && k < count; ++k) {
    PyObject* col = cols[(size_t)k].take();
    if (col == nullptr) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, k, col);
  }
  return out;
}

}  // namespace copytrace
