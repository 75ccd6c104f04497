// copytrace's observer: what its units share. Each unit includes its own torch headers first
// (none for the Python-only units) and this header last.
//
// The units, by responsibility (module.cpp holds the one list of entry points):
//   kernels.cpp    kernels of aten's copy/alias ops (BackendSelect; _to_copy: backends), depth
//   api_mode.cpp   the C __torch_function__, the recorded call and its one-call fast path (*)
//   warn_shim.cpp  warnings.warn counting stacklevel as untraced            (Python only)
//   versions.cpp   version counters of fresh copies; weak pointers on grad_fn nodes
//   lean.cpp       level lean's C wrappers and descriptors                  (*)
//   hotpatch.cpp   level lean's hot-patched method tables                   (*)
//   legacy.cpp     tp_new trampolines of the legacy constructors (torch.Tensor([a, b]))  (*)
//   facts.cpp      a tensor's facts in one call; copy_slots
//   steps.cpp      optimizer steps from torch's Optimizer.step# record scope
//   frames.cpp     call sites, frame variables                              (Python only)
//   audit.cpp      the os.exec audit hook, calling Python on that event only (Python only)
//   record.cpp     an API call's whole event in one call, by the rule table (_rules.RULES)
//   attached.cpp   an attached copy's tag, entry and call-site count in C       (Python only)
//   watch_cb.cpp   level lean's write watch: a RecordFunction callback while a tensor is watched
//   compiled.cpp   the compiled-call hooks                                  (*)
//   columns.cpp    a run of event records as Arrow column buffers (export)  (Python only)
//   otlp.cpp       the OTLP/JSON text of copy-event spans from those columns (Python only)
//   module.cpp     the method table and the module's init                   (Python only)
// (*) Python and ATen's/c10's mode TLS headers only (no Tensor type). The units that include
//     Tensor's headers (kernels, versions, facts, record, watch_cb) are built as one translation
//     unit, torch_units.cpp, which includes them: one parse of those headers instead of five.
//
// Cross-unit state is declared here. Thread-local counters are `__thread` plain data (no C++
// thread_local wrapper call at each access) and everything declared here has hidden
// visibility, so their accesses stay as cheap as in one unit.
#pragma once

#if defined(COPYTRACE_TORCH_TLS)
#include <ATen/PythonTorchFunctionTLS.h>
#endif
#include <Python.h>
#include <structmember.h>

#include <atomic>
#include <cstring>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <vector>

#pragma GCC visibility push(hidden)

namespace copytrace {

// A growable stack in thread-local plain data (no destructor: a thread's buffer is a few
// hundred bytes, kept until the process ends).
template <typename T>
struct TlsStack {
  T* data;
  size_t size;
  size_t cap;
};

template <typename T>
inline void push(TlsStack<T>& s, T value) {
  if (s.size == s.cap) {
    const size_t cap = s.cap != 0 ? 2 * s.cap : 64;
    T* grown = static_cast<T*>(std::realloc(s.data, cap * sizeof(T)));
    if (grown == nullptr) return;  // out of memory: the fold misses a name
    s.data = grown;
    s.cap = cap;
  }
  s.data[s.size++] = value;
}

// --- kernels.cpp ------------------------------------------------------------------------------
extern std::atomic<bool> g_on;
extern std::atomic<int64_t> g_internal;
extern std::atomic<int64_t> g_errors;
extern std::vector<PyObject*> g_py_names;  // interned Python str per op index (owned)
extern __thread bool tls_owner;
extern __thread int tls_suppress;
extern __thread int tls_depth;
extern __thread bool tls_folding;
extern __thread TlsStack<int16_t> tls_fold;
void suppress_region();
void unsuppress_region();

// Whether `handle` is one of this thread's current thread-local RecordFunction callbacks. The
// thread's RecordFunctionTLS is swapped by at::ThreadLocalStateGuard (the autograd engine runs
// a backward under the graph task's copy, restored when backward returns) and emptied by
// at::clearCallbacks: a callback added inside such a scope is gone after it, and
// at::removeCallback of a handle not found logs "Requested callback is not found"
// (aten/src/ATen/record_function.cpp) on the program's stderr. Remove only when present.
bool in_tls(uint64_t handle);  // handle: an at::CallbackHandle; defined in kernels.cpp

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The folded aten names since folding began, as a new tuple (the fold emptied).
inline PyObject* fold_names() {
  PyObject* names = PyTuple_New(static_cast<Py_ssize_t>(tls_fold.size));
  if (names == nullptr) return nullptr;
  for (size_t i = 0; i < tls_fold.size; ++i)
    PyTuple_SET_ITEM(names, static_cast<Py_ssize_t>(i), Py_NewRef(g_py_names[tls_fold.data[i]]));
  tls_fold.size = 0;
  return names;
}

// The error a pending call raises: the one given_back() took (its references).
struct GivenBack {
  PyObject* type;
  PyObject* value;
  PyObject* tb;
};

// A pending call on the main thread: raise the error given back, where the program runs,
// without copytrace's frames (its traceback starts again from here, as if the signal had
// come at this bytecode, which is where it would have been handled untraced).
inline int raise_given_back(void* arg) {
  auto* held = static_cast<GivenBack*>(arg);
  PyErr_NormalizeException(&held->type, &held->value, &held->tb);
  Py_CLEAR(held->tb);
  if (held->value != nullptr) PyException_SetTraceback(held->value, Py_None);
  PyErr_Restore(held->type, held->value, nullptr);  // steals the references
  delete held;
  return -1;  // Python raises it at this bytecode boundary
}

// Whether the Python error set now is the program's, handed back (cleared here): a
// KeyboardInterrupt or SystemExit (not an Exception) on the main thread is one that a signal
// handler raised while copytrace's own code ran for the program (Python runs handlers between
// any two bytecodes of the main thread; Ctrl-C's raises KeyboardInterrupt), never copytrace's
// own. Counting it would lose the program's Ctrl-C: it is raised again, the same object with
// at the main thread's next bytecode boundary (Py_AddPendingCall, called with
// the GIL held on the main thread, not from a C signal handler: that is where it is safe).
inline bool given_back() {
  PyObject* type = PyErr_Occurred();
  if (type == nullptr || PyErr_GivenExceptionMatches(type, PyExc_Exception) ||
      !_PyOS_IsMainThread())
    return false;
  auto* held = new GivenBack{nullptr, nullptr, nullptr};
  PyErr_Fetch(&held->type, &held->value, &held->tb);
  if (Py_AddPendingCall(raise_given_back, held) == 0) return true;
  PyErr_Restore(held->type, held->value, held->tb);  // the queue is full: counted as before
  delete held;
  return false;
}

// An error in copytrace's own hook: counted, never raised into the program (an interrupt a
// signal handler raised in it is the program's: given_back()).
inline void swallow() {
  if (given_back()) return;
  g_errors.fetch_add(1, std::memory_order_relaxed);
  PyErr_Clear();
}

// A global reference set from Python: `value` (None stores null) is taken, the old released.
inline void set_slot(PyObject*& slot, PyObject* value) {
  PyObject* old = slot;
  slot = value == Py_None ? nullptr : Py_NewRef(value);
  Py_XDECREF(old);
}

// Argument count check of a METH_FASTCALL entry point: false with TypeError(signature).
inline bool arity(Py_ssize_t nargs, Py_ssize_t want, const char* signature) {
  if (nargs == want) return true;
  PyErr_SetString(PyExc_TypeError, signature);
  return false;
}

// Named __slots__ of one class, their offsets found once per class (the class held): a slot
// read in place costs a load, where PyObject_GetAttr looks the descriptor up in the type.
template <int N>
struct Slots {
  const char* const* names;  // N names
  PyTypeObject* type = nullptr;
  Py_ssize_t at[N] = {};
  // Whether obj's class has every named slot (looked up now for a new class; no error set).
  bool of(PyObject* obj) {
    PyTypeObject* t = Py_TYPE(obj);
    if (t == type) return true;
    if (t->tp_members == nullptr || t->tp_dictoffset != 0) return false;
    Py_ssize_t found[N];
    for (int i = 0; i < N; ++i) {
      found[i] = -1;
      for (PyMemberDef* m = t->tp_members; m->name != nullptr; ++m)
        if (m->type == T_OBJECT_EX && std::strcmp(m->name, names[i]) == 0) found[i] = m->offset;
      if (found[i] < 0) return false;
    }
    for (int i = 0; i < N; ++i) at[i] = found[i];
    PyTypeObject* old = type;
    type = reinterpret_cast<PyTypeObject*>(Py_NewRef(t));
    Py_XDECREF(old);
    return true;
  }
  // slot i of obj (of(obj) true): borrowed, null while unset
  PyObject* get(PyObject* obj, int i) const {
    return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + at[i]);
  }
  // store value (a new reference) in slot i of obj, the old value released
  void put(PyObject* obj, int i, PyObject* value) const {
    PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + at[i]);
    PyObject* old = *slot;
    *slot = value;
    Py_XDECREF(old);
  }
};

inline PyObject* call_through(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (kwargs == nullptr || kwargs == Py_None || !PyDict_Check(kwargs) ||
      PyDict_GET_SIZE(kwargs) == 0)
    return PyObject_Call(func, args, nullptr);
  return PyObject_Call(func, args, kwargs);
}

// --- api_mode.cpp -----------------------------------------------------------------------------
extern PyObject* g_table;  // dict: torch callable -> op name (null: no recorder connected)
// Frames of handle_torch_function that re-entered a Python-level torch function through
// copytrace's mode, innermost last (borrowed: each is on the stack while listed).
extern __thread TlsStack<PyObject*> tls_entry_frames;
PyObject* call_through_recorded(PyObject* func, PyObject* args, PyObject* kwargs, bool lean);
// The same for a call already known to be op `op` (a callable outside the table: legacy.cpp).
PyObject* call_op_recorded(PyObject* op, PyObject* func, PyObject* args, PyObject* kwargs,
                           bool lean);

// --- versions.cpp -----------------------------------------------------------------------------
PyObject* version_of(PyObject*, PyObject* obj);
PyObject* kept_pair(PyObject* a, PyObject* b);  // (a, b), untracked when a and b are
bool versions_init(PyObject* module);
// A C++ autograd node as Python sees it (a THPCppFunction): its sequence number in *seq and in
// *leaf_version (a new reference) what _api_events.leaf_version(node) reads: the version of
// the leaf an AccumulateGrad on its first edge holds, else None. False: not such a node.
bool node_facts(PyObject* node, long long* seq, PyObject** leaf_version);

// --- lean.cpp ---------------------------------------------------------------------------------
extern std::atomic<bool> g_wrappers_on;
extern PyObject* g_data_get;  // Tensor.data.__get__ / __set__ of the original descriptor
extern PyObject* g_data_set;
bool in_quiet_code();

#if defined(COPYTRACE_TORCH_TLS)
// Whether the lean wrappers record this call: as a mode would, nothing while torch function
// handling is off (torch's internals, copytrace's bookkeeping).
inline bool wrappers_record() {
  return g_wrappers_on.load(std::memory_order_relaxed) && tls_owner && !tls_folding &&
         tls_suppress == 0 && g_table != nullptr &&
         at::impl::PythonTorchFunctionTLS::get_disabled_state() !=
             at::impl::TorchFunctionDisabledState::ALL_DISABLED;
}

// Torch function handling off (modes and subclasses) while copytrace's own Python code runs:
// no other mode sees copytrace's bookkeeping (reading .requires_grad, .grad_fn, ...).
struct NoTorchFunction {
  at::impl::TorchFunctionDisabledState prev;
  NoTorchFunction() : prev(at::impl::PythonTorchFunctionTLS::get_disabled_state()) {
    at::impl::PythonTorchFunctionTLS::set_disabled_state(
        at::impl::TorchFunctionDisabledState::ALL_DISABLED);
  }
  ~NoTorchFunction() { at::impl::PythonTorchFunctionTLS::set_disabled_state(prev); }
};
#endif

// --- facts.cpp --------------------------------------------------------------------------------
// A tensor's facts, by index (the Facts struct sequence's fields, in this order).
#define COPYTRACE_FACTS(X)                                                                      \
  X(shape) X(dtype) X(device) X(requires_grad) X(is_leaf) X(grad_fn) X(grad_fn_name) X(storage) \
  X(storage_bytes) X(logical_bytes) X(offset) X(stride) X(version) X(fake)
enum Fact : int {
#define COPYTRACE_FACT_ENUM(name) FACT_##name,
  COPYTRACE_FACTS(COPYTRACE_FACT_ENUM)
#undef COPYTRACE_FACT_ENUM
  FACT_COUNT
};
// Fills items (new references) for a plain tensor: 1; not one (the Python readers decide): 0;
// an error set: -1 (items all null).
// want: a mask of 1 << Fact of the items to read (the others are None).
constexpr unsigned kAllFacts = (1u << FACT_COUNT) - 1;
int read_facts(PyObject* t, bool with_grad_fn, PyObject* items[FACT_COUNT],
               unsigned want = kAllFacts);
PyObject* copy_slots(PyObject*, PyObject* proto);
bool facts_init(PyObject* module);
// A tensor's grad_fn's sequence number in *seq (-1: no grad_fn; unchanged: not a tensor);
// false where reading it failed.
bool grad_fn_sequence_nr(PyObject* t, long long* seq);
// The StorageImpl of tensor t's storage (as storage_of reads it), or null where it has none.
void* storage_impl_of(PyObject* t);

// --- frames.cpp -------------------------------------------------------------------------------
PyObject* call_site(PyObject*, PyObject* const* argv, Py_ssize_t nargs);
PyObject* innermost_frame_of(PyObject* code);
PyObject* frame_var_of(PyFrameObject* frame, PyObject* name);  // new reference or null

// --- record.cpp -------------------------------------------------------------------------------
PyObject* record(PyObject*, PyObject* const* argv, Py_ssize_t nargs);
bool record_init(PyObject* module);
// RULES.watched and RULES.not_fresh (frozensets borrowed from the rules set_record_rules keeps;
// null while none are set): fast_finish's share of the rule table.
extern PyObject* g_rule_watched;
extern PyObject* g_rule_not_fresh;
extern PyObject* g_rule_alias_watched;

// --- attached.cpp -----------------------------------------------------------------------------
// An attached copy's end in C (api_mode.cpp's fast_finish): 1 done, 0 left to Python (nothing
// changed), -1 an error set (part done: the caller counts it and keeps the event).
int attached_finish(PyObject* rec, PyObject* watch, PyObject* ev, PyObject* out,
                    PyObject* grad_fn, PyObject* kind);

// --- compiled.cpp -----------------------------------------------------------------------------
extern __thread bool tls_cfs_thread;

// --- entry points (module.cpp lists them, with their documentation) ---------------------------
#define COPYTRACE_NOARGS(name) PyObject* name(PyObject*, PyObject*);
#define COPYTRACE_O(name) PyObject* name(PyObject*, PyObject*);
#define COPYTRACE_FAST(name) PyObject* name(PyObject*, PyObject* const*, Py_ssize_t);
// kernels.cpp
COPYTRACE_FAST(py_install) COPYTRACE_NOARGS(py_uninstall) COPYTRACE_O(py_set_enabled)
COPYTRACE_NOARGS(py_enabled) COPYTRACE_O(py_set_owner) COPYTRACE_NOARGS(py_suppress)
COPYTRACE_NOARGS(py_unsuppress) COPYTRACE_NOARGS(py_suppressed) COPYTRACE_NOARGS(py_begin_fold)
COPYTRACE_NOARGS(py_end_fold) COPYTRACE_NOARGS(py_internal_detaches) COPYTRACE_NOARGS(py_errors)
COPYTRACE_NOARGS(py_depth)
// api_mode.cpp
COPYTRACE_FAST(py_set_api_hooks) COPYTRACE_FAST(py_set_fast_events) COPYTRACE_FAST(py_set_fast_api)
COPYTRACE_O(py_set_watch_writes) COPYTRACE_FAST(py_set_copy_hooks) COPYTRACE_O(py_bind_torch_function)
COPYTRACE_NOARGS(py_entry_frames) COPYTRACE_NOARGS(py_has_entry_frames)
// warn_shim.cpp
COPYTRACE_O(py_make_warn)
// versions.cpp
COPYTRACE_O(py_version_delta) COPYTRACE_O(py_version_final) COPYTRACE_O(py_grad_fn_ref)
COPYTRACE_O(py_grad_fn_of) COPYTRACE_O(py_grad_fn_alive) COPYTRACE_FAST(py_kept_pair)
// lean.cpp
COPYTRACE_FAST(py_wrap_api) COPYTRACE_FAST(py_data_descriptor) COPYTRACE_O(py_set_wrappers)
COPYTRACE_O(py_set_quiet_codes)
// hotpatch.cpp
COPYTRACE_FAST(py_hot_install) COPYTRACE_NOARGS(py_hot_restore) COPYTRACE_NOARGS(py_hot_count)
// legacy.cpp
COPYTRACE_FAST(py_legacy_install) COPYTRACE_FAST(py_legacy_restore)
// facts.cpp
COPYTRACE_FAST(py_facts)
PyObject* py_sizes_strides_policy(PyObject*, PyObject* t);
PyObject* py_sizes_default(PyObject*, PyObject* t);
PyObject* py_storage_of(PyObject*, PyObject* t);
PyObject* py_storage_hold(PyObject*, PyObject* address);
PyObject* py_storage_owners(PyObject*, PyObject* address);
// steps.cpp
COPYTRACE_FAST(py_set_step_hooks)
COPYTRACE_FAST(py_set_step_idle)
COPYTRACE_O(py_set_step_code) COPYTRACE_NOARGS(py_optimizer_step_seen)
// audit.cpp
COPYTRACE_O(py_exec_hook)
// frames.cpp
COPYTRACE_NOARGS(py_clear_sites) COPYTRACE_FAST(py_frame_var)
COPYTRACE_FAST(py_module_calls)
// record.cpp
COPYTRACE_FAST(py_record_setup) COPYTRACE_O(py_set_record_rules)
// watch_cb.cpp
COPYTRACE_FAST(py_watch_tensor) COPYTRACE_FAST(py_unwatch) COPYTRACE_O(py_set_watch_hook)
COPYTRACE_NOARGS(py_watched)
// attached.cpp
COPYTRACE_FAST(py_set_attached)
// compiled.cpp
COPYTRACE_O(py_callback_from_stance) COPYTRACE_FAST(py_cfs_install) COPYTRACE_O(py_cfs_begin)
COPYTRACE_NOARGS(py_compiled_enter) COPYTRACE_FAST(py_compiled_backward)
COPYTRACE_FAST(py_user_fn_install) COPYTRACE_FAST(py_cc_install)
// columns.cpp
COPYTRACE_FAST(py_event_columns)
// otlp.cpp
COPYTRACE_FAST(py_span_json)
#undef COPYTRACE_NOARGS
#undef COPYTRACE_O
#undef COPYTRACE_FAST

}  // namespace copytrace

#pragma GCC visibility pop
