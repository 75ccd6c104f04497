// Level "lean": torch's own method tables hot-patched while tracing.
// CPython reads a builtin's C function pointer at each call: a method_descriptor
// (TensorBase.clone) and a method bound from it (x.clone) call d_method/m_ml->ml_meth
// (Objects/descrobject.c, Objects/methodobject.c, ceval's specialized calls), and a
// builtin_function_or_method (torch.clone) is called through its own `vectorcall` field, or
// tp_call where that is NULL. So while tracing, instead of replacing attributes:
//   * a Tensor method's PyMethodDef (torch's method table, writable memory) gets `ml_meth` =
//     a trampoline of its own slot (hot_meth<I>, one per slot, generated over an index);
//   * a function of torch (torch.clone: one object, however it was imported) gets its
//     `vectorcall` = hot_vcall<I>. Not its ml_meth: a builtin function's hash is derived from
//     ml_meth (meth_hash), and torch functions are keys of many dicts (torch.overrides, dynamo);
//   * Tensor.data's PyGetSetDef gets get/set = hot_data_get/hot_data_set.
// Objects keep their identity (torch.Tensor.clone is torch._C.TensorBase.clone: dynamo,
// torch.overrides and the program's modes see torch's own callables), methods bound and
// functions imported before tracing started are recorded, and no class attribute changes (no
// type-cache flush). A trampoline calls the original pointer straight away unless the wrappers
// record (wrappers_record) and no hot-patched call is already being recorded on this thread
// (tls_hot_depth: call_through_recorded calls the table's callable, which comes back here, and
// so does a program's mode calling `func`); else it records through call_through_recorded, as
// the attribute wrappers (api_wrapper) do. Each swap is one aligned pointer store with the GIL
// held; hot_restore puts every original back (also at interpreter exit, see _observer.py).
// Only the conventions met in torch's tables are swapped: METH_VARARGS|METH_KEYWORDS,
// METH_NOARGS and METH_O methods, static functions; anything else keeps its attribute wrapper.
// Python only, with ATen's torch-function TLS header for wrappers_record (observer.h).
#define COPYTRACE_TORCH_TLS
#include "observer.h"

#include <array>
#include <cstdio>
#include <utility>

namespace copytrace {
namespace {
enum class HotKind : int { kVarKw, kNoArgs, kO, kVcall };

struct HotSlot {
  HotKind kind = HotKind::kVarKw;
  PyObject* key = nullptr;           // owned: the API table's callable
  PyMethodDef* def = nullptr;        // kVarKw, kNoArgs, kO: torch's entry
  PyCFunction orig_meth = nullptr;   //   and its original ml_meth
  PyCFunctionObject* fn = nullptr;   // kVcall: the function object (held through key)
  vectorcallfunc orig_vcall = nullptr;  //   and its original vectorcall (NULL: tp_call)
  PyCFunction installed = nullptr;   // what hot_install stored (checked at restore)
  vectorcallfunc installed_vcall = nullptr;
};

constexpr size_t kHotSlots = 64;
HotSlot g_hot[kHotSlots];
size_t g_hot_count = 0;
thread_local int tls_hot_depth = 0;
PyGetSetDef* g_hot_getset = nullptr;  // Tensor.data's entry while swapped
getter g_hot_get = nullptr;           // its original get/set
setter g_hot_set = nullptr;

template <typename T>
inline void store_ptr(T* slot, T value) {
  __atomic_store_n(slot, value, __ATOMIC_RELEASE);  // one aligned store
}

inline bool hot_records() { return tls_hot_depth == 0 && wrappers_record(); }

// Record one call through the table's callable: `args` is the call's tuple (no self).
PyObject* hot_record(const HotSlot& s, PyObject* self, PyObject* args, PyObject* kwargs) {
  PyObject* key = s.key;
  PyObject* full;
  if (s.kind == HotKind::kVcall) {
    full = Py_NewRef(args);
  } else {  // a method: the table's callable is the descriptor, called as (self, *args)
    const Py_ssize_t n = PyTuple_GET_SIZE(args);
    full = PyTuple_New(n + 1);
    if (full == nullptr) return nullptr;
    PyTuple_SET_ITEM(full, 0, Py_NewRef(self));
    for (Py_ssize_t i = 0; i < n; ++i)
      PyTuple_SET_ITEM(full, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
  }
  Py_INCREF(key);  // hot_restore may run inside the call
  ++tls_hot_depth;
  PyObject* r = call_through_recorded(key, full, kwargs, true);
  --tls_hot_depth;
  Py_DECREF(key);
  Py_DECREF(full);
  return r;
}

template <size_t I>
PyObject* hot_varkw(PyObject* self, PyObject* args, PyObject* kwargs) {
  const HotSlot& s = g_hot[I];
  if (!hot_records())
    return reinterpret_cast<PyCFunctionWithKeywords>(
        reinterpret_cast<void (*)()>(s.orig_meth))(self, args, kwargs);
  return hot_record(s, self, args, kwargs);
}

template <size_t I>
PyObject* hot_noargs(PyObject* self, PyObject* unused) {
  const HotSlot& s = g_hot[I];
  if (!hot_records()) return s.orig_meth(self, unused);
  PyObject* args = PyTuple_New(0);
  if (args == nullptr) return nullptr;
  PyObject* r = hot_record(s, self, args, nullptr);
  Py_DECREF(args);
  return r;
}

template <size_t I>
PyObject* hot_o(PyObject* self, PyObject* arg) {
  const HotSlot& s = g_hot[I];
  if (!hot_records()) return s.orig_meth(self, arg);
  PyObject* args = PyTuple_Pack(1, arg);
  if (args == nullptr) return nullptr;
  PyObject* r = hot_record(s, self, args, nullptr);
  Py_DECREF(args);
  return r;
}

// The original call of a static function: its own vectorcall, else tp_call on a tuple and a
// dict, as CPython's _PyObject_MakeTpCall does.
PyObject* hot_vcall_orig(const HotSlot& s, PyObject* callable, PyObject* const* args,
                         size_t nargsf, PyObject* kwnames, PyObject** tuple_out = nullptr,
                         PyObject** dict_out = nullptr) {
  if (tuple_out == nullptr && s.orig_vcall != nullptr)
    return s.orig_vcall(callable, args, nargsf, kwnames);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  PyObject* tuple = PyTuple_New(nargs);
  if (tuple == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < nargs; ++i) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
  PyObject* dict = nullptr;
  const Py_ssize_t nkw = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nkw > 0) {
    dict = PyDict_New();
    for (Py_ssize_t i = 0; dict != nullptr && i < nkw; ++i) {
      if (PyDict_SetItem(dict, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
        Py_CLEAR(dict);
    }
    if (dict == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
  }
  if (tuple_out != nullptr) {  // the caller records: hand over the tuple and dict
    *tuple_out = tuple;
    *dict_out = dict;
    return Py_NewRef(Py_None);
  }
  PyObject* r = nullptr;
  if (Py_EnterRecursiveCall(" while calling a Python object") == 0) {
    r = Py_TYPE(callable)->tp_call(callable, tuple, dict);
    Py_LeaveRecursiveCall();
  }
  Py_DECREF(tuple);
  Py_XDECREF(dict);
  return r;
}

template <size_t I>
PyObject* hot_vcall(PyObject* callable, PyObject* const* args, size_t nargsf,
                    PyObject* kwnames) {
  const HotSlot& s = g_hot[I];
  if (!hot_records()) return hot_vcall_orig(s, callable, args, nargsf, kwnames);
  PyObject *tuple = nullptr, *dict = nullptr;
  PyObject* none = hot_vcall_orig(s, callable, args, nargsf, kwnames, &tuple, &dict);
  if (none == nullptr) return nullptr;
  Py_DECREF(none);
  PyObject* r = hot_record(s, nullptr, tuple, dict);
  Py_DECREF(tuple);
  Py_XDECREF(dict);
  return r;
}

using MethTable = std::array<PyCFunction, kHotSlots>;
using VcallTable = std::array<vectorcallfunc, kHotSlots>;

template <size_t... I>
MethTable varkw_table(std::index_sequence<I...>) {
  return {reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&hot_varkw<I>))...};
}
template <size_t... I>
MethTable noargs_table(std::index_sequence<I...>) {
  return {&hot_noargs<I>...};
}
template <size_t... I>
MethTable o_table(std::index_sequence<I...>) {
  return {&hot_o<I>...};
}
template <size_t... I>
VcallTable vcall_table(std::index_sequence<I...>) {
  return {&hot_vcall<I>...};
}
const MethTable g_hot_varkw = varkw_table(std::make_index_sequence<kHotSlots>{});
const MethTable g_hot_noargs = noargs_table(std::make_index_sequence<kHotSlots>{});
const MethTable g_hot_o = o_table(std::make_index_sequence<kHotSlots>{});
const VcallTable g_hot_vcall = vcall_table(std::make_index_sequence<kHotSlots>{});

// Whether `p` lies in a writable mapping of this process (/proc/self/maps; false where that
// cannot be read): torch's tables are, but a read-only one must never be written.
bool writable(const void* p) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  char line[512];
  bool ok = false;
  while (std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long lo = 0, hi = 0;
    char perms[5] = {0};
    if (std::sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3) continue;
    if (addr >= lo && addr + sizeof(void*) <= hi) {
      ok = perms[1] == 'w';
      break;
    }
  }
  std::fclose(maps);
  return ok;
}

void hot_restore() {
  for (size_t i = 0; i < g_hot_count; ++i) {
    HotSlot& s = g_hot[i];
    if (s.kind == HotKind::kVcall) {
      if (s.fn->vectorcall == s.installed_vcall) store_ptr(&s.fn->vectorcall, s.orig_vcall);
    } else if (s.def->ml_meth == s.installed) {
      store_ptr(&s.def->ml_meth, s.orig_meth);
    }
    Py_CLEAR(s.key);
  }
  g_hot_count = 0;
  if (g_hot_getset != nullptr) {
    store_ptr(&g_hot_getset->get, g_hot_get);
    store_ptr(&g_hot_getset->set, g_hot_set);
    g_hot_getset = nullptr;
  }
}

PyObject* hot_data_get(PyObject* obj, void* closure) {
  if (!hot_records() || g_data_get == nullptr) return g_hot_get(obj, closure);
  PyObject* args = PyTuple_Pack(1, obj);
  if (args == nullptr) return nullptr;
  ++tls_hot_depth;
  PyObject* r = call_through_recorded(g_data_get, args, nullptr, true);
  --tls_hot_depth;
  Py_DECREF(args);
  return r;
}

int hot_data_set(PyObject* obj, PyObject* value, void* closure) {
  if (value == nullptr || !hot_records() || g_data_set == nullptr)
    return g_hot_set(obj, value, closure);
  PyObject* args = PyTuple_Pack(2, obj, value);
  if (args == nullptr) return -1;
  ++tls_hot_depth;
  PyObject* r = call_through_recorded(g_data_set, args, nullptr, true);
  --tls_hot_depth;
  Py_DECREF(args);
  if (r == nullptr) return -1;
  Py_DECREF(r);
  return 0;
}


// A callable's slot, checked (not yet stored): false where its convention is not handled.
bool hot_slot(PyObject* obj, const std::vector<HotSlot>& slots, HotSlot& s) {
  bool ok = false;
  if (Py_IS_TYPE(obj, &PyMethodDescr_Type)) {
    s.def = reinterpret_cast<PyMethodDescrObject*>(obj)->d_method;
    const int flags = s.def->ml_flags & ~METH_COEXIST;
    ok = true;
    if (flags == (METH_VARARGS | METH_KEYWORDS)) s.kind = HotKind::kVarKw;
    else if (flags == METH_NOARGS) s.kind = HotKind::kNoArgs;
    else if (flags == METH_O) s.kind = HotKind::kO;
    else ok = false;
    for (const HotSlot& other : slots)
      ok = ok && other.def != s.def;  // one entry, one slot
    ok = ok && writable(&s.def->ml_meth);
    if (ok) s.orig_meth = s.def->ml_meth;
  } else if (Py_IS_TYPE(obj, &PyCFunction_Type)) {
    s.fn = reinterpret_cast<PyCFunctionObject*>(obj);
    // a function: no self, its module or (a static method: torch.clone) its class; never
    // a method bound to a tensor
    ok = s.fn->m_self == nullptr || PyModule_Check(s.fn->m_self) || PyType_Check(s.fn->m_self);
    s.kind = HotKind::kVcall;
    for (const HotSlot& other : slots)
      ok = ok && other.fn != s.fn;
    if (ok) s.orig_vcall = s.fn->vectorcall;
  }
  return ok && slots.size() < kHotSlots;
}

// Every check passed: the stores (none can fail).
void hot_store(const std::vector<HotSlot>& slots, PyGetSetDef* getset, PyObject* get,
               PyObject* set) {
  for (size_t i = 0; i < slots.size(); ++i) {
    HotSlot& s = g_hot[i];
    s = slots[i];
    if (s.kind == HotKind::kVcall) {
      s.installed_vcall = g_hot_vcall[i];
    } else {
      s.installed = s.kind == HotKind::kVarKw    ? g_hot_varkw[i]
                    : s.kind == HotKind::kNoArgs ? g_hot_noargs[i]
                                                 : g_hot_o[i];
    }
  }
  g_hot_count = slots.size();
  for (size_t i = 0; i < g_hot_count; ++i) {
    HotSlot& s = g_hot[i];
    if (s.kind == HotKind::kVcall) store_ptr(&s.fn->vectorcall, s.installed_vcall);
    else store_ptr(&s.def->ml_meth, s.installed);
  }
  if (getset != nullptr) {
    set_slot(g_data_get, get);
    set_slot(g_data_set, set);
    g_hot_get = getset->get;
    g_hot_set = getset->set;
    g_hot_getset = getset;
    store_ptr(&getset->get, static_cast<getter>(&hot_data_get));
    store_ptr(&getset->set, static_cast<setter>(&hot_data_set));
  }
}

}  // namespace

// hot_install(callables, data, get, set) -> [bool per callable, bool for data]: swap the
// pointers of every callable whose convention is handled (True) and, where `data` is
// Tensor.data's getset descriptor, its get/set (recorded as calls of `get`, `set`: its
// __get__, __set__, the API table's keys). Everything is checked before the first store; a
// second install first restores the previous one.
PyObject* py_hot_install(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "hot_install(callables, data, get, set)")) return nullptr;
  PyObject* seq = PySequence_Fast(argv[0], "hot_install: a list of callables");
  if (seq == nullptr) return nullptr;
  hot_restore();
  std::vector<HotSlot> slots;
  PyObject* done = PyList_New(0);
  for (Py_ssize_t i = 0; done != nullptr && i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* obj = PySequence_Fast_GET_ITEM(seq, i);
    HotSlot s;
    const bool ok = hot_slot(obj, slots, s);
    if (ok) {
      s.key = Py_NewRef(obj);
      slots.push_back(s);
    }
    if (PyList_Append(done, ok ? Py_True : Py_False) < 0) Py_CLEAR(done);
  }
  Py_DECREF(seq);
  PyObject *data = argv[1], *get = argv[2], *set = argv[3];
  PyGetSetDef* getset = nullptr;
  if (data != Py_None && get != Py_None && set != Py_None &&
      Py_IS_TYPE(data, &PyGetSetDescr_Type)) {
    getset = reinterpret_cast<PyGetSetDescrObject*>(data)->d_getset;
    if (getset->get == nullptr || getset->set == nullptr || !writable(&getset->get))
      getset = nullptr;
  }
  if (done == nullptr || PyList_Append(done, getset != nullptr ? Py_True : Py_False) < 0) {
    for (HotSlot& s : slots) Py_DECREF(s.key);
    Py_XDECREF(done);
    return nullptr;
  }
  hot_store(slots, getset, get, set);
  return done;
}

PyObject* py_hot_restore(PyObject*, PyObject*) {
  hot_restore();
  Py_RETURN_NONE;
}

PyObject* py_hot_count(PyObject*, PyObject*) {
  return PyLong_FromSize_t(g_hot_count + (g_hot_getset != nullptr ? 1 : 0));
}

}  // namespace copytrace
