// copytrace's dispatcher-level copy observer.
//
// Boxed kernels for only aten's copy and alias ops (clone, _to_copy, copy_, the *_copy ops,
// detach, alias, ...), registered on the BackendSelect dispatch key. BackendSelect is in every
// thread's default TLS include set and sits below Autograd, Functionalize, the Python key and
// the Python mode keys, so each kernel sees one op call on plain tensors and re-dispatches it
// below BackendSelect unchanged. Every other op never reaches this code: unlike a Python
// TorchDispatchMode, this costs nothing per non-copy op, does not make torch.compile skip
// frames, and leaves tensor subclass creation (S(t), _make_subclass, as_subclass) alone.
//
// Per call of an observed op, on the traced thread (or autograd's engine working for it):
//   * inside an API call the TorchFunctionMode is recording (begin_fold/end_fold): append the
//     op's index to a thread-local list; the Python side folds those names into its event;
//   * a bare detach/alias: autograd's own bookkeeping; counted, not recorded;
//   * any other copy op: an implicit copy; after it ran, take the GIL and hand its arguments,
//     result and host times (CLOCK_MONOTONIC ns, as time.perf_counter_ns) to the Python
//     callback, which records it exactly as the Python dispatch mode did.
// Outside tracing, or inside compiled regions and copytrace's own callback (suppress depth),
// a kernel only re-dispatches.
//
// Only _to_copy already has a BackendSelect kernel (generated; it picks the backend from the
// dtype/layout/device arguments): ours repeats that computation (RegisterBackendSelect.cpp).
#include <torch/extension.h>
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
// Python 3.11: the interpreter frame's layout, for frame_var (no public accessor before 3.12)
#define Py_BUILD_CORE 1
#include <internal/pycore_code.h>
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <ATen/record_function.h>
#include <unordered_set>

#include <algorithm>
#include <initializer_list>
#include <cstring>
#include <deque>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <thread>
#include <vector>

namespace {

constexpr int kAlias = 1;  // detach, alias: autograd bookkeeping unless folded into an API call

struct OpInfo {
  int index = 0;
  int kind = 0;
  bool to_copy = false;  // replaces the generated BackendSelect kernel of aten::_to_copy
};

std::unordered_map<const c10::FunctionSchema*, OpInfo> g_ops;
std::vector<std::string> g_names;
std::vector<py::object> g_py_names;  // interned Python str per op index
std::unique_ptr<torch::Library> g_lib;
std::atomic<bool> g_on{false};
std::atomic<int64_t> g_internal{0};
std::atomic<int64_t> g_errors{0};
PyObject* g_callback = nullptr;  // owned reference; changed only with the GIL held

// Nesting, as a Python TorchDispatchMode sees it: the mode sees an op only when no other op
// is inside its backend kernels (torch pops the mode while its handler runs). A RecordFunction
// callback (no inputs, no outputs) counts the ops in progress on each thread that are not
// CompositeImplicitAutograd (those decompose above the backend, where a mode sees their
// parts). A copy op is implicit only at depth 1: itself. Deeper ones are a kernel's own
// internals (addmm copying its bias, _to_copy's copy_).
// RecordFunction::name() of every non-composite operator overload: the schema's own string,
// so named RecordFunctions (RECORD_FUNCTION("detach") in autograd kernels, profiler scopes)
// never match.
std::unordered_set<const char*> g_counted;
// The callback is thread-local: registered on the thread that starts tracing (the owner), it
// reaches the threads that run that thread's work with its ThreadLocalState (the autograd
// engine's device threads). Only the owner thread can deregister it (removeCallback of another
// thread's handle warns): an uninstall from any other thread leaves it in place, where it only
// counts depth, and a later install on the owner thread reuses it.
at::CallbackHandle g_rf = 0;
std::thread::id g_rf_thread;
// Inside a compiled region (suppress) the observer ignores every op, so the callback is paused
// there, on this thread only (disableCallback of a thread-local handle): a compiled call's ops
// then cost what they cost untraced. An op in progress keeps its own callbacks (RecordFunction
// holds them from its start), so the depth stays balanced across the pause.
thread_local int tls_rf_paused = 0;
thread_local int tls_depth = 0;
// An autograd node's apply (BACKWARD_FUNCTION scope) starts afresh: the ops a node runs are
// what a dispatch mode sees in backward, whatever op is in progress around the engine.
thread_local std::vector<int> tls_saved_depth;

std::unique_ptr<at::ObserverContext> rf_start(const at::RecordFunction& fn) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    tls_saved_depth.push_back(tls_depth);
    tls_depth = 0;
  } else if (g_counted.count(fn.name()) != 0) {
    ++tls_depth;
  }
  return nullptr;
}

void rf_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    if (!tls_saved_depth.empty()) {
      tls_depth = tls_saved_depth.back();
      tls_saved_depth.pop_back();
    }
  } else if (tls_depth > 0 && g_counted.count(fn.name()) != 0) {
    --tls_depth;
  }
}

void counted_names() {
  if (!g_counted.empty()) return;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    auto handle = dispatcher.findOp(name);
    if (handle && handle->hasSchema() &&
        !handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
      g_counted.insert(handle->schema().name().c_str());
  }
}

thread_local bool tls_owner = false;
thread_local int tls_suppress = 0;
thread_local bool tls_folding = false;
thread_local std::vector<int16_t> tls_fold;

const c10::DispatchKeySet kAfterBS(c10::DispatchKeySet::FULL_AFTER,
                                   c10::DispatchKey::BackendSelect);

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
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

class SilentWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

c10::DispatchKeySet to_copy_keys(const torch::jit::Stack& stack, size_t base) {
  // aten::_to_copy(Tensor self, *, ScalarType? dtype, Layout? layout, Device? device, ...)
  const auto& self = stack[base].toTensor();
  auto dtype = stack[base + 1].toOptional<at::ScalarType>();
  auto layout = stack[base + 2].toOptional<at::Layout>();
  auto device = stack[base + 3].toOptional<at::Device>();
  c10::DispatchKeySet s = c10::DispatchKeySet(c10::computeDispatchKey(dtype, layout, device)) |
                          c10::detail::multi_dispatch_key_set(self);
  return c10::impl::computeDispatchKeySet(s, kAfterBS);
}

bool on_meta(const torch::jit::Stack& stack, size_t base, size_t nargs) {
  // FakeTensor and meta traffic (torch.compile's tracing, FakeTensorMode's meta kernels):
  // not a copy of real memory. The Python side records fake copies at the API level.
  for (size_t i = 0; i < nargs; ++i) {
    const auto& v = stack[base + i];
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      return t.defined() && t.device().is_meta();
    }
  }
  return false;
}

void call_back(const OpInfo& info, const c10::FunctionSchema& schema,
               std::vector<c10::IValue>& args, const c10::IValue& out, int64_t t0, int64_t t1) {
  py::gil_scoped_acquire gil;
  if (g_callback == nullptr) return;
  NoTorchFunction no_tf;
  ++tls_suppress;
  try {
    const auto& arguments = schema.arguments();
    py::list pos;
    py::dict kw;
    for (size_t i = 0; i < args.size() && i < arguments.size(); ++i) {
      py::object value = torch::jit::toPyObject(std::move(args[i]));
      if (arguments[i].kwarg_only()) {
        kw[py::str(arguments[i].name())] = value;
      } else {
        pos.append(value);
      }
    }
    py::object result = out.isNone() ? py::none() : torch::jit::toPyObject(out);
    py::handle cb(g_callback);
    cb(g_py_names[info.index], info.kind, py::tuple(pos), kw, result, t0, t1);
  } catch (py::error_already_set& e) {
    g_errors.fetch_add(1, std::memory_order_relaxed);
    e.discard_as_unraisable(__func__);
  } catch (...) {
    g_errors.fetch_add(1, std::memory_order_relaxed);
  }
  --tls_suppress;
}

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  auto found = g_ops.find(&schema);
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  c10::DispatchKeySet next = ks & kAfterBS;
  if (found == g_ops.end()) {  // cannot happen: only registered ops come here
    op.redispatchBoxed(next, stack);
    return;
  }
  const OpInfo& info = found->second;
  if (info.to_copy) next = to_copy_keys(*stack, base);
  if (!g_on.load(std::memory_order_relaxed) || tls_suppress > 0 ||
      !(tls_owner || torch::autograd::get_current_node() != nullptr)) {
    op.redispatchBoxed(next, stack);
    return;
  }
  if (tls_depth > 1) {  // inside another op's kernel: not an op a dispatch mode would see
    op.redispatchBoxed(next, stack);
    return;
  }
  if (tls_folding) {
    tls_fold.push_back(static_cast<int16_t>(info.index));
    op.redispatchBoxed(next, stack);
    return;
  }
  if (info.kind == kAlias) {
    g_internal.fetch_add(1, std::memory_order_relaxed);
    op.redispatchBoxed(next, stack);
    return;
  }
  if (on_meta(*stack, base, nargs)) {
    op.redispatchBoxed(next, stack);
    return;
  }
  // The arguments are consumed by the call: keep them (reference counts only, no data).
  std::vector<c10::IValue> args(stack->begin() + base, stack->end());
  const int64_t t0 = now_ns();
  op.redispatchBoxed(next, stack);
  const int64_t t1 = now_ns();
  c10::IValue out = schema.returns().size() == 1 && !stack->empty() ? stack->back()
                                                                     : c10::IValue();
  call_back(info, schema, args, out, t0, t1);
}

// Unboxed kernels for the two observed ops autograd and optimizers call most (AccumulateGrad's
// detach, copy_): the same decisions as `kernel` without boxing the arguments for the calls
// that only re-dispatch or fold (almost all); an implicit copy_ goes through `kernel` boxed.
int g_detach_index = -1;
int g_copy_index = -1;

// 0: only re-dispatch; 1: fold (index appended); 2: record (alias: counted; copy: boxed path)
inline int decide(int index) {
  if (index < 0 || !g_on.load(std::memory_order_relaxed) || tls_suppress > 0 ||
      !(tls_owner || torch::autograd::get_current_node() != nullptr) || tls_depth > 1)
    return 0;
  if (tls_folding) {
    tls_fold.push_back(static_cast<int16_t>(index));
    return 1;
  }
  return 2;
}

at::Tensor detach_kernel(c10::DispatchKeySet ks, const at::Tensor& self) {
  if (decide(g_detach_index) == 2) g_internal.fetch_add(1, std::memory_order_relaxed);
  return at::_ops::detach::redispatch(ks & kAfterBS, self);
}

at::Tensor& copy__kernel(c10::DispatchKeySet ks, at::Tensor& self, const at::Tensor& src,
                         bool non_blocking) {
  if (decide(g_copy_index) == 2) {
    if (!tls_folding) {  // decide() appends only when folding: an implicit copy_
      static const c10::OperatorHandle op =
          c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
      torch::jit::Stack stack{self, src, non_blocking};
      kernel(op, ks, &stack);
      return self;
    }
  }
  return at::_ops::copy_::redispatch(ks & kAfterBS, self, src, non_blocking);
}

// install([(qualified name, overload, kind, display name), ...], callback): register the kernels.
int install(const std::vector<std::tuple<std::string, std::string, int, std::string>>& ops,
            py::object callback) {
  if (g_lib) return static_cast<int>(g_ops.size());
  auto& dispatcher = c10::Dispatcher::singleton();
  SilentWarnings silent;  // "Overriding a previously registered kernel" for _to_copy
  c10::WarningUtils::WarningHandlerGuard guard(&silent);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                              std::optional<c10::DispatchKey>(), __FILE__,
                                              __LINE__);
  for (const auto& [name, overload, kind, display] : ops) {
    auto handle = dispatcher.findSchema(c10::OperatorName(name, overload));
    if (!handle) continue;
    const c10::FunctionSchema* schema = &handle->schema();
    if (g_ops.count(schema) == 0) {
      OpInfo info;
      info.index = static_cast<int>(g_names.size());
      info.kind = kind;
      info.to_copy = name == "aten::_to_copy" && overload.empty();
      g_names.push_back(display);
      g_py_names.push_back(py::reinterpret_steal<py::object>(
          PyUnicode_InternFromString(display.c_str())));
      g_ops.emplace(schema, info);
    }
    std::string short_name = name.substr(name.find("::") + 2);
    if (!overload.empty()) short_name += "." + overload;
    const int index = g_ops[schema].index;
    if (name == "aten::detach" && overload.empty()) {
      g_detach_index = index;
      lib->impl("detach", torch::dispatch(c10::DispatchKey::BackendSelect,
                                          TORCH_FN(detach_kernel)));
      continue;
    }
    if (name == "aten::copy_" && overload.empty()) {
      g_copy_index = index;
      lib->impl("copy_", torch::dispatch(c10::DispatchKey::BackendSelect,
                                         TORCH_FN(copy__kernel)));
      continue;
    }
    lib->impl(short_name.c_str(),
              torch::dispatch(c10::DispatchKey::BackendSelect,
                              torch::CppFunction::makeFromBoxedFunction<&kernel>()));
  }
  g_lib = std::move(lib);
  counted_names();
  if (g_rf != 0 && g_rf_thread != std::this_thread::get_id()) g_rf = 0;  // left on another thread
  if (g_rf == 0) {
    g_rf = at::addThreadLocalCallback(at::RecordFunctionCallback(&rf_start, &rf_end)
                                          .needsInputs(false)
                                          .needsOutputs(false)
                                          .scopes({at::RecordScope::FUNCTION,
                                                   at::RecordScope::BACKWARD_FUNCTION}));
    g_rf_thread = std::this_thread::get_id();
  }
  Py_XDECREF(g_callback);
  g_callback = callback.release().ptr();
  return static_cast<int>(g_ops.size());
}

// A compiled region: no op of it is observed, and the depth callback pauses on this thread.
void suppress_region() {
  ++tls_suppress;
  if (g_rf != 0 && tls_rf_paused == 0 && g_rf_thread == std::this_thread::get_id()) {
    at::disableCallback(g_rf);
    tls_rf_paused = 1;
  }
}

void unsuppress_region() {
  if (tls_suppress > 0) --tls_suppress;
  if (tls_suppress == 0 && tls_rf_paused != 0) {
    tls_rf_paused = 0;
    if (g_rf != 0) at::reenableCallback(g_rf);
  }
}

void uninstall() {
  g_on.store(false);
  if (g_rf != 0 && g_rf_thread == std::this_thread::get_id()) {
    at::removeCallback(g_rf);
    g_rf = 0;
  }
  if (g_lib) {
    SilentWarnings silent;
    c10::WarningUtils::WarningHandlerGuard guard(&silent);
    g_lib.reset();  // deregisters: torch's own _to_copy BackendSelect kernel is back
  }
  Py_XDECREF(g_callback);
  g_callback = nullptr;
}

py::tuple end_fold() {
  tls_folding = false;
  py::tuple names(tls_fold.size());
  for (size_t i = 0; i < tls_fold.size(); ++i) names[i] = g_py_names[tls_fold[i]];
  tls_fold.clear();
  return names;
}


// --- API level: the TorchFunctionMode's handler, in C -------------------------------------
// Installed as the mode object's __torch_function__. A call that is not in the table goes
// straight to `func` from C: no Python frame of copytrace's is on the stack, so a warning torch
// raises names the same frame, module and line as untraced, and the per-call cost is a dict
// lookup. A recorded call runs before(op, func, args, kwargs) -> token, then `func` (from C),
// then after(token, result, error type, t0, t1, folded aten names); both hooks run with torch
// function handling disabled, so no other mode or subclass sees copytrace's bookkeeping.
PyObject* g_table = nullptr;   // dict: torch callable -> op name
PyObject* g_before = nullptr;
PyObject* g_after = nullptr;
PyObject* g_write_hook = nullptr;  // called for every call while g_watch_writes
// One call instead of before + after (set_fast_api): a call of an op in g_fast_ops, with no
// keyword arguments, whose first argument's type is exactly one of g_fast_types (torch.Tensor,
// nn.Parameter), runs from C and then goes to g_fast_after(op, args, result, error type, t0,
// t1, folded aten names). The before hook has nothing to do for such a call: no torch function
// override or Python code of the program's can run inside it.
PyObject* g_fast_ops = nullptr;    // frozenset of op names
PyObject* g_fast_types = nullptr;  // tuple of exact types
PyObject* g_fast_after = nullptr;
std::atomic<bool> g_watch_writes{false};
// In-place writes into fresh copies (copytrace/tracer/_fresh.py): g_fresh maps id(tensor) of
// the live copies to their entries, g_written holds the written advanced-index results that
// wait for a use. g_copy_hook(func, args, kwargs) runs only for a call whose first argument is
// in g_fresh, or any call while g_written is not empty.
PyObject* g_fresh = nullptr;
PyObject* g_written = nullptr;
PyObject* g_copy_hook = nullptr;
PyObject* g_getitem = nullptr;  // Tensor.__getitem__: basic indexing returns a view, no event

// An index of ints, slices, None, Ellipsis (or a tuple of them): basic indexing.
inline bool basic_item(PyObject* o) {
  return PyLong_Check(o) || PySlice_Check(o) || o == Py_None || o == Py_Ellipsis;
}

inline bool basic_index(PyObject* args) {
  if (PyTuple_GET_SIZE(args) < 2) return false;
  PyObject* index = PyTuple_GET_ITEM(args, 1);
  if (basic_item(index)) return true;
  if (!PyTuple_CheckExact(index)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(index); ++i) {
    if (!basic_item(PyTuple_GET_ITEM(index, i))) return false;
  }
  return true;
}

inline bool copy_hook_wanted(PyObject* args) {
  if (g_copy_hook == nullptr || g_fresh == nullptr || PyDict_GET_SIZE(g_fresh) == 0) return false;
  if (g_written != nullptr && PyDict_GET_SIZE(g_written) > 0) return true;
  if (PyTuple_GET_SIZE(args) == 0) return false;
  PyObject* key = PyLong_FromVoidPtr(PyTuple_GET_ITEM(args, 0));  // id(args[0])
  if (key == nullptr) {
    PyErr_Clear();
    return false;
  }
  int found = PyDict_Contains(g_fresh, key);
  Py_DECREF(key);
  if (found < 0) PyErr_Clear();
  return found == 1;
}


inline PyObject* call_through(PyObject* func, PyObject* args, PyObject* kwargs) {
  if (kwargs == nullptr || kwargs == Py_None || !PyDict_Check(kwargs) || PyDict_GET_SIZE(kwargs) == 0)
    return PyObject_Call(func, args, nullptr);
  return PyObject_Call(func, args, kwargs);
}

// A global reference set from Python: `value`'s reference is taken (None stores null) and
// the previous one released.
void set_slot(PyObject*& slot, py::object& value) {
  PyObject* old = slot;
  slot = value.is_none() ? nullptr : value.release().ptr();
  Py_XDECREF(old);
}

inline void swallow() {
  // An error in copytrace's own hook: counted, never raised into the program.
  g_errors.fetch_add(1, std::memory_order_relaxed);
  PyErr_Clear();
}

PyObject* fold_names() {
  PyObject* names = PyTuple_New(static_cast<Py_ssize_t>(tls_fold.size()));
  if (names == nullptr) return nullptr;
  for (size_t i = 0; i < tls_fold.size(); ++i) {
    PyObject* n = g_py_names[tls_fold[i]].ptr();
    Py_INCREF(n);
    PyTuple_SET_ITEM(names, static_cast<Py_ssize_t>(i), n);
  }
  tls_fold.clear();
  return names;
}

// Frames of handle_torch_function that re-entered a Python-level torch function through
// copytrace's mode, innermost last; copytrace's warnings.warn shim skips them (and the outer
// call of the same function), so that a warning with a stacklevel names the frame it names
// untraced.
thread_local std::vector<PyObject*> tls_entry_frames;

PyObject* call_through_recorded(PyObject* func, PyObject* args, PyObject* kwargs,
                                bool lean = false);

inline bool fast_call(PyObject* op, PyObject* args, PyObject* kwargs) {
  if (kwargs != nullptr && kwargs != Py_None &&
      (!PyDict_Check(kwargs) || PyDict_GET_SIZE(kwargs) != 0))
    return false;
  if (PyTuple_GET_SIZE(args) == 0 || g_fast_ops == nullptr || g_fast_types == nullptr)
    return false;
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(PyTuple_GET_ITEM(args, 0)));
  bool exact = false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g_fast_types); ++i)
    exact = exact || PyTuple_GET_ITEM(g_fast_types, i) == type;
  if (!exact) return false;
  int found = PySet_Contains(g_fast_ops, op);
  if (found < 0) PyErr_Clear();
  return found == 1;
}

// The whole event of a fast call, in C, where it is the common case: observer.cpp's record
// builds it with its call site, phase and module placed, and no grad_fn to tag; the watch has
// nothing to start (an alias, or a fresh copy followed by its version counter); it is appended
// to the recorder's events. Any other outcome goes to g_fast_tail(op, src, out, ev, grad_fn,
// placed) (Recorder.api_tail), and a call record cannot read (not a plain tensor) to
// g_fast_after. Returns false for the latter.
PyObject* g_fast_rec = nullptr;         // the Recorder
PyObject* g_fast_copies = nullptr;      // its watch's FreshCopies
PyObject* g_fast_tail = nullptr;
PyObject* g_fast_event_ops = nullptr;   // frozenset: ops whose event may be finished here
PyObject* version_of(PyObject*, PyObject* obj);
}  // namespace
namespace copytrace_facts {
PyObject* record(PyObject*, PyObject* const* argv, Py_ssize_t nargs);  // end of this file
}  // namespace copytrace_facts
namespace {
PyObject* intern_name(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;  // kept for the life of the process
}

struct FastNames {
  PyObject *group, *native_state, *events, *dropped, *step_index, *in_optimizer, *alias, *via,
      *graph, *bytes_allocated, *inplace_writes, *max_events, *overhead_ns, *kept, *limit,
      *prune, *detach;
  FastNames()
      : group(intern_name("group")), native_state(intern_name("_native_state")),
        events(intern_name("events")), dropped(intern_name("dropped")),
        step_index(intern_name("step_index")), in_optimizer(intern_name("in_optimizer")),
        alias(intern_name("alias")), via(intern_name("via")), graph(intern_name("graph")),
        bytes_allocated(intern_name("bytes_allocated")), inplace_writes(intern_name("inplace_writes")),
        max_events(intern_name("max_events")), overhead_ns(intern_name("overhead_ns")),
        kept(intern_name("kept")), limit(intern_name("_limit")), prune(intern_name("_prune")),
        detach(intern_name("detach")) {}
};
FastNames* g_fn = nullptr;

// attribute `name` of `obj` as a long long (-1 and an error set on failure)
inline long long attr_ll(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) return -1;
  long long r = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return r;
}

inline bool add_ll(PyObject* obj, PyObject* name, long long delta) {
  long long v = attr_ll(obj, name);
  if (v == -1 && PyErr_Occurred()) return false;
  PyObject* n = PyLong_FromLongLong(v + delta);
  if (n == nullptr) return false;
  int rc = PyObject_SetAttr(obj, name, n);
  Py_DECREF(n);
  return rc == 0;
}

// The event's end, when nothing calls for Python: true when done (or an error counted).
bool fast_finish(PyObject* op, PyObject* src, PyObject* out, PyObject* ev) {
  PyObject* alias_o = PyObject_GetAttr(ev, g_fn->alias);
  if (alias_o == nullptr) return false;
  const bool alias = alias_o == Py_True;
  Py_DECREF(alias_o);
  if (PyUnicode_Check(op) && PyUnicode_Compare(op, g_fn->detach) == 0) {
    PyObject* via = PyObject_GetAttr(ev, g_fn->via);  // a detach from state_dict(): watched
    const bool plain = via == Py_None;
    Py_XDECREF(via);
    if (!plain) return false;
  }
  if (!alias) {
    PyObject* graph = PyObject_GetAttr(ev, g_fn->graph);
    const bool attached = graph != nullptr && PyUnicode_Check(graph) &&
                          PyUnicode_CompareWithASCIIString(graph, "attached") == 0;
    Py_XDECREF(graph);
    if (graph == nullptr || attached) return false;
    const long long nbytes = attr_ll(ev, g_fn->bytes_allocated);
    if (nbytes == -1 && PyErr_Occurred()) return false;
    if (out != src && nbytes > 0) {  // a fresh copy: its version counter kept (_fresh.py)
      PyObject* version = version_of(nullptr, out);
      if (version == nullptr || version == Py_None) {
        Py_XDECREF(version);
        return false;
      }
      PyObject* kept = PyObject_GetAttr(g_fast_copies, g_fn->kept);
      PyObject* zero = PyLong_FromLong(0);
      PyObject* item = PyTuple_Pack(2, version, ev);
      Py_DECREF(version);
      bool ok = kept != nullptr && zero != nullptr && item != nullptr &&
                PyObject_SetAttr(ev, g_fn->inplace_writes, zero) == 0 &&
                PyList_Check(kept) && PyList_Append(kept, item) == 0;
      Py_XDECREF(zero);
      Py_XDECREF(item);
      if (ok) {
        const long long limit = attr_ll(g_fast_copies, g_fn->limit);
        if (PyList_GET_SIZE(kept) >= limit) {
          PyObject* r = PyObject_CallMethodNoArgs(g_fast_copies, g_fn->prune);
          if (r == nullptr) ok = false; else Py_DECREF(r);
        }
      }
      Py_XDECREF(kept);
      if (!ok) swallow();  // counted; the event is still kept below
    }
  }
  PyObject* events = PyObject_GetAttr(g_fast_rec, g_fn->events);
  const long long max_events = attr_ll(g_fast_rec, g_fn->max_events);
  if (events == nullptr || !PyList_Check(events) || PyErr_Occurred()) {
    Py_XDECREF(events);
    swallow();
    return true;
  }
  if (PyList_GET_SIZE(events) < max_events) {
    if (PyList_Append(events, ev) < 0) swallow();
  } else if (!add_ll(g_fast_rec, g_fn->dropped, 1)) {
    swallow();
  }
  Py_DECREF(events);
  return true;
}

// Record a fast call's event (result `out`, no error); false: g_fast_after must record it.
bool fast_event(PyObject* op, PyObject* args, PyObject* out, int64_t t0, int64_t t1,
                PyObject* names) {
  if (g_fast_rec == nullptr || g_fast_event_ops == nullptr || !THPVariable_Check(out) ||
      PySet_Contains(g_fast_event_ops, op) != 1)
    return false;
  PyObject* group = PyObject_GetAttr(g_fast_rec, g_fn->group);
  PyObject* state = PyObject_GetAttr(g_fast_rec, g_fn->native_state);
  PyObject* events = PyObject_GetAttr(g_fast_rec, g_fn->events);
  const long long dropped = attr_ll(g_fast_rec, g_fn->dropped);
  PyObject* step = PyObject_GetAttr(g_fast_rec, g_fn->step_index);
  PyObject* inopt = PyObject_GetAttr(g_fast_rec, g_fn->in_optimizer);
  PyObject* found = nullptr;
  bool usable = group == Py_None && state != nullptr && state != Py_None && events != nullptr &&
                PyList_Check(events) && step != nullptr && inopt != nullptr && !PyErr_Occurred();
  if (usable) {
    PyObject* seq = PyLong_FromLongLong(PyList_GET_SIZE(events) + dropped);
    PyObject* t0o = PyLong_FromLongLong(t0);
    PyObject* t1o = PyLong_FromLongLong(t1);
    PyObject* src = PyTuple_GET_ITEM(args, 0);
    if (seq != nullptr && t0o != nullptr && t1o != nullptr) {
      PyObject* argv[11] = {state, op, src, out, Py_None, seq, t0o, t1o, names, step, inopt};
      found = copytrace_facts::record(nullptr, argv, 11);
    }
    Py_XDECREF(seq);
    Py_XDECREF(t0o);
    Py_XDECREF(t1o);
  }
  Py_XDECREF(group);
  Py_XDECREF(state);
  Py_XDECREF(events);
  Py_XDECREF(step);
  Py_XDECREF(inopt);
  if (PyErr_Occurred() || (usable && found == nullptr)) {
    Py_XDECREF(found);
    PyErr_Clear();
    return false;  // the Python path records it (and counts what fails there)
  }
  if (found == nullptr || found == Py_None) {
    Py_XDECREF(found);
    return false;
  }
  if (found == Py_False) {  // no event (an integer index's view)
    Py_DECREF(found);
    return true;
  }
  PyObject* src = PyTuple_GET_ITEM(args, 0);
  PyObject* ev = PyTuple_GET_ITEM(found, 0);
  PyObject* grad_fn = PyTuple_GET_ITEM(found, 1);
  PyObject* placed = PyTuple_GET_ITEM(found, 2);
  bool done = placed == Py_True && grad_fn == Py_None && fast_finish(op, src, out, ev);
  if (PyErr_Occurred()) swallow();
  if (!done && g_fast_tail != nullptr) {
    PyObject* r = PyObject_CallFunctionObjArgs(g_fast_tail, op, src, out, ev, grad_fn, placed,
                                               nullptr);
    if (r == nullptr) swallow(); else Py_DECREF(r);
  }
  Py_DECREF(found);
  if (!add_ll(g_fast_rec, g_fn->overhead_ns, now_ns() - t1)) swallow();
  return true;
}

// A backward entry point (Tensor.backward, torch.autograd.backward/grad) on one tensor while
// no .data write or rebinding is pending: Watch.check_backward reduced to what it does then,
// noting the root's sequence number (Watch._note_backward). True when done.
PyObject* g_fast_watch = nullptr;  // the Recorder's Watch
PyObject* g_backward_op = nullptr;
PyObject* g_backward_seq = nullptr;
PyObject* g_writes = nullptr;
PyObject* g_rebinds = nullptr;

bool fast_backward(PyObject* op, PyObject* args) {
  if (g_fast_watch == nullptr || op != g_backward_op || PyTuple_GET_SIZE(args) == 0 ||
      !THPVariable_Check(PyTuple_GET_ITEM(args, 0)))
    return false;
  for (PyObject* name : {g_writes, g_rebinds}) {
    PyObject* pending = PyObject_GetAttr(g_fast_watch, name);
    const int busy = pending != nullptr ? PyObject_IsTrue(pending) : -1;
    Py_XDECREF(pending);
    if (busy != 0) {
      PyErr_Clear();
      return false;
    }
  }
  const auto& node = THPVariable_Unpack(PyTuple_GET_ITEM(args, 0)).grad_fn();
  if (!node) return true;
  const long long seq = static_cast<long long>(node->sequence_nr());
  const long long seen = attr_ll(g_fast_watch, g_backward_seq);
  if (seen == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  if (seq > seen) {
    PyObject* value = PyLong_FromLongLong(seq);
    if (value == nullptr || PyObject_SetAttr(g_fast_watch, g_backward_seq, value) < 0) swallow();
    Py_XDECREF(value);
  }
  return true;
}

// set_fast_events(rec, copies, tail, ops): the C end of fast events (None clears).
void set_fast_events(py::object rec, py::object copies, py::object tail, py::object ops) {
  if (g_fn == nullptr) g_fn = new FastNames();
  if (g_backward_op == nullptr) {
    g_backward_op = intern_name("backward");
    g_backward_seq = intern_name("_backward_seq");
    g_writes = intern_name("writes");
    g_rebinds = intern_name("rebinds");
  }
  Py_CLEAR(g_fast_watch);
  if (!rec.is_none()) g_fast_watch = PyObject_GetAttrString(rec.ptr(), "watch");
  if (PyErr_Occurred()) PyErr_Clear();
  set_slot(g_fast_rec, rec);
  set_slot(g_fast_copies, copies);
  set_slot(g_fast_tail, tail);
  set_slot(g_fast_event_ops, ops);
}

void set_fast_api(py::object ops, py::object types, py::object after) {
  set_slot(g_fast_ops, ops);
  set_slot(g_fast_types, types);
  set_slot(g_fast_after, after);
}
bool in_quiet_code();

PyObject* torch_function(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs < 3) {
    PyErr_SetString(PyExc_TypeError, "__torch_function__(func, types, args=(), kwargs=None)");
    return nullptr;
  }
  PyObject* func = argv[0];
  PyObject* args = argv[2];
  PyObject* kwargs = nargs > 3 ? argv[3] : Py_None;
  PyObject* owned_args = nullptr;
  if (!PyTuple_Check(args)) {
    owned_args = PySequence_Tuple(args);
    if (owned_args == nullptr) return nullptr;
    args = owned_args;
  }
  struct Drop { PyObject* p; ~Drop() { Py_XDECREF(p); } } drop{owned_args};
  if (tls_folding || g_table == nullptr) return call_through(func, args, kwargs);
  if (PyFunction_Check(func)) {
    // A Python-level torch function (F.softmax, Tensor.backward...) re-entered through
    // handle_torch_function: remember that frame while it runs (see entry_frames).
    PyObject* frame = reinterpret_cast<PyObject*>(PyEval_GetFrame());  // borrowed
    tls_entry_frames.push_back(frame);
    PyObject* r = call_through_recorded(func, args, kwargs);
    tls_entry_frames.pop_back();
    return r;
  }
  return call_through_recorded(func, args, kwargs);
}

// Run `func` with the aten ops it causes folded and its host times taken, then hand the call
// to after(*lead, result or None, error type or None, t0, t1, folded aten names) with torch
// function handling off; with `fast_op`, fast_event may record it in C instead. The call's
// result or exception is returned as is.
PyObject* run_folded(PyObject* func, PyObject* args, PyObject* kwargs, PyObject* after,
                     std::initializer_list<PyObject*> lead, PyObject* fast_op) {
  tls_fold.clear();
  tls_folding = true;
  const int64_t t0 = now_ns();
  PyObject* result = call_through(func, args, kwargs);
  const int64_t t1 = now_ns();
  tls_folding = false;
  PyObject *etype = nullptr, *evalue = nullptr, *etb = nullptr;
  if (result == nullptr) PyErr_Fetch(&etype, &evalue, &etb);
  PyObject* names = fold_names();
  if (fast_op != nullptr && result != nullptr && names != nullptr) {
    NoTorchFunction guard;
    if (fast_event(fast_op, args, result, t0, t1, names)) {
      Py_DECREF(names);
      return result;
    }
  }
  PyObject* t0o = PyLong_FromLongLong(t0);
  PyObject* t1o = PyLong_FromLongLong(t1);
  if (names != nullptr && t0o != nullptr && t1o != nullptr) {
    NoTorchFunction guard;
    PyObject* argv[8];
    size_t n = 0;
    for (PyObject* a : lead) argv[n++] = a;
    argv[n++] = result != nullptr ? result : Py_None;
    argv[n++] = etype != nullptr ? etype : Py_None;
    argv[n++] = t0o;
    argv[n++] = t1o;
    argv[n++] = names;
    PyObject* r = PyObject_Vectorcall(after, argv, n, nullptr);
    if (r == nullptr) swallow(); else Py_DECREF(r);
  } else {
    swallow();
  }
  Py_XDECREF(names);
  Py_XDECREF(t0o);
  Py_XDECREF(t1o);
  if (result == nullptr) PyErr_Restore(etype, evalue, etb);
  return result;
}

PyObject* call_through_recorded(PyObject* func, PyObject* args, PyObject* kwargs, bool lean) {
  if (kwargs == nullptr) kwargs = Py_None;  // the hooks take kwargs as an argument
  if (g_watch_writes.load(std::memory_order_relaxed) && g_write_hook != nullptr) {
    NoTorchFunction guard;
    PyObject* r = PyObject_CallFunctionObjArgs(g_write_hook, func, args, kwargs, nullptr);
    if (r == nullptr) swallow(); else Py_DECREF(r);
  }
  if (copy_hook_wanted(args)) {
    NoTorchFunction guard;
    PyObject* r = PyObject_CallFunctionObjArgs(g_copy_hook, func, args, kwargs, nullptr);
    if (r == nullptr) swallow(); else Py_DECREF(r);
  }
  if (func == g_getitem && basic_index(args)) return call_through(func, args, kwargs);
  PyObject* op = PyDict_GetItemWithError(g_table, func);  // borrowed
  if (op == nullptr) {
    if (PyErr_Occurred()) PyErr_Clear();  // an unhashable callable
    return call_through(func, args, kwargs);
  }
  if (lean && in_quiet_code()) return call_through(func, args, kwargs);
  if ((kwargs == nullptr || kwargs == Py_None ||
       (PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) == 0)) &&
      fast_backward(op, args))
    return call_through(func, args, kwargs);
  if (g_fast_after != nullptr && fast_call(op, args, kwargs))
    return run_folded(func, args, kwargs, g_fast_after, {op, args}, op);
  PyObject* token;
  {
    NoTorchFunction guard;
    token = PyObject_CallFunctionObjArgs(g_before, op, func, args, kwargs, nullptr);
  }
  if (token == nullptr) {
    swallow();
    return call_through(func, args, kwargs);
  }
  if (token == Py_None) {
    Py_DECREF(token);
    return call_through(func, args, kwargs);
  }
  PyObject* result = run_folded(func, args, kwargs, g_after, {token}, nullptr);
  Py_DECREF(token);
  return result;
}

PyMethodDef g_tf_def = {"torch_function", reinterpret_cast<PyCFunction>(
                            reinterpret_cast<void (*)()>(&torch_function)),
                        METH_FASTCALL, "copytrace's __torch_function__ (see observer.cpp)"};

void set_api_hooks(py::object table, py::object before, py::object after, py::object write_hook) {
  set_slot(g_table, table);
  set_slot(g_before, before);
  set_slot(g_after, after);
  set_slot(g_write_hook, write_hook);
}


// --- warnings.warn while tracing ------------------------------------------------------------
// Installed as warnings.warn (copytrace/tracer/_warnshim.py): a C function, so it adds no
// frame to tracebacks (-W error) and stacklevel 1 is still the caller. Where the frames
// between the caller and the stacklevel's target include a handle_torch_function frame that
// copytrace's mode re-entered from (tls_entry_frames), that frame and the outer call of the
// same torch function above it are not counted: the warning names the frame it names
// untraced. Everything else goes to the original warnings.warn unchanged.
PyObject* g_orig_warn = nullptr;

PyObject* warn_shim(PyObject*, PyObject* args, PyObject* kwargs) {
  if (g_orig_warn == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "copytrace warnings shim not installed");
    return nullptr;
  }
  if (tls_entry_frames.empty()) return PyObject_Call(g_orig_warn, args, kwargs);
  // stacklevel: third positional argument or keyword
  Py_ssize_t nargs = PyTuple_GET_SIZE(args);
  PyObject* level_obj = nargs > 2 ? PyTuple_GET_ITEM(args, 2)
                                  : (kwargs ? PyDict_GetItemString(kwargs, "stacklevel") : nullptr);
  long level = level_obj ? PyLong_AsLong(level_obj) : 1;
  if (level == -1 && PyErr_Occurred()) return nullptr;
  if (level <= 1) return PyObject_Call(g_orig_warn, args, kwargs);
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed: the caller of warn
  Py_XINCREF(frame);
  long steps = 0, counted = 1;
  auto back = [](PyFrameObject*& f) {
    PyFrameObject* b = PyFrame_GetBack(f);  // new reference
    Py_DECREF(f);
    f = b;
  };
  while (frame != nullptr && counted < level) {
    back(frame);
    ++steps;
    if (frame != nullptr &&
        std::find(tls_entry_frames.begin(), tls_entry_frames.end(),
                  reinterpret_cast<PyObject*>(frame)) != tls_entry_frames.end()) {
      back(frame);  // the outer call of the same torch function
      if (frame != nullptr) back(frame);
      steps += 2;
    }
    ++counted;
  }
  Py_XDECREF(frame);
  long adjusted = steps + 1;  // stacklevel 1 = the caller
  if (adjusted == level) return PyObject_Call(g_orig_warn, args, kwargs);
  PyObject* new_level = PyLong_FromLong(adjusted);
  if (new_level == nullptr) return nullptr;
  PyObject* result = nullptr;
  if (nargs > 2) {
    PyObject* copy = PyTuple_GetSlice(args, 0, nargs);
    if (copy != nullptr) {
      Py_INCREF(new_level);
      PyObject* old = PyTuple_GET_ITEM(copy, 2);
      PyTuple_SET_ITEM(copy, 2, new_level);
      Py_DECREF(old);
      result = PyObject_Call(g_orig_warn, copy, kwargs);
      Py_DECREF(copy);
    }
  } else {
    PyObject* kw = kwargs ? PyDict_Copy(kwargs) : PyDict_New();
    if (kw != nullptr && PyDict_SetItemString(kw, "stacklevel", new_level) == 0)
      result = PyObject_Call(g_orig_warn, args, kw);
    Py_XDECREF(kw);
  }
  Py_DECREF(new_level);
  return result;
}

PyMethodDef g_warn_def = {"warn", reinterpret_cast<PyCFunction>(
                              reinterpret_cast<void (*)()>(&warn_shim)),
                          METH_VARARGS | METH_KEYWORDS,
                          "warnings.warn, counting stacklevel as untraced (copytrace)"};

void set_copy_hooks(py::object fresh, py::object written, py::object hook, py::object getitem) {
  set_slot(g_fresh, fresh);
  set_slot(g_written, written);
  set_slot(g_copy_hook, hook);
  set_slot(g_getitem, getitem);
}


// --- version counters of fresh copies (copytrace/tracer/_fresh.py) ---------------------------
// A fresh copy's in-place writes are how far its version counter advanced while it lived. The
// counter (c10::VariableVersion) is shared by a tensor and all its views and is bumped by every
// in-place op, out= included. version_of(tensor) returns a small object holding the counter (a
// refcounted VersionCounter: it keeps neither the tensor nor its storage alive) and its value
// now; version_delta(that object) is how far it advanced since, readable after the tensor died,
// and version_final(that object) the same once no tensor shares the counter any more.
// version_of gives None for what has no counter (inference tensors, non-tensors).
// set_lean_mode(on): level lean's function mode is on the traced thread's stack (the wrappers
// stand aside, the mode records).
std::atomic<bool> g_lean_mode{false};

struct VersionRef {
  PyObject_HEAD
  c10::VariableVersion counter;  // constructed in place by version_of
  uint32_t start;
};

void version_dealloc(PyObject* self) {
  reinterpret_cast<VersionRef*>(self)->counter.~VariableVersion();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyType_Slot g_version_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(&version_dealloc)},
    {Py_tp_doc, const_cast<char*>("a tensor's version counter and its value when read")},
    {0, nullptr}};
PyType_Spec g_version_spec = {"copytrace_observer.VersionRef", sizeof(VersionRef), 0,
                              Py_TPFLAGS_DEFAULT, g_version_slots};
PyTypeObject* g_version_type = nullptr;

PyObject* version_of(PyObject*, PyObject* obj) {
  if (g_version_type == nullptr || !THPVariable_Check(obj)) Py_RETURN_NONE;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined()) Py_RETURN_NONE;
    const c10::VariableVersion& counter = t.unsafeGetTensorImpl()->version_counter();
    if (!counter.enabled()) Py_RETURN_NONE;  // an inference tensor
    const uint32_t start = counter.current_version();
    PyObject* self = PyType_GenericAlloc(g_version_type, 0);
    if (self == nullptr) return nullptr;
    auto* ref = reinterpret_cast<VersionRef*>(self);
    new (&ref->counter) c10::VariableVersion(counter);
    ref->start = start;
    return self;
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
}

PyObject* version_delta(PyObject*, PyObject* obj) {
  if (g_version_type == nullptr || Py_TYPE(obj) != g_version_type) {
    PyErr_SetString(PyExc_TypeError, "version_delta() takes what version_of() returned");
    return nullptr;
  }
  auto* ref = reinterpret_cast<VersionRef*>(obj);
  const uint32_t now = ref->counter.current_version();
  return PyLong_FromUnsignedLong(static_cast<uint32_t>(now - ref->start));
}

// version_final(handle) -> the delta once no tensor shares the counter any more (the copy and
// all its views are gone: this handle holds the only reference), else None
PyObject* version_final(PyObject*, PyObject* obj) {
  if (g_version_type == nullptr || Py_TYPE(obj) != g_version_type) {
    PyErr_SetString(PyExc_TypeError, "version_final() takes what version_of() returned");
    return nullptr;
  }
  auto* ref = reinterpret_cast<VersionRef*>(obj);
  if (!ref->counter.unique()) Py_RETURN_NONE;
  const uint32_t now = ref->counter.current_version();
  return PyLong_FromUnsignedLong(static_cast<uint32_t>(now - ref->start));
}

PyMethodDef g_version_of_def = {"version_of", &version_of, METH_O,
                                "version_of(tensor) -> a handle on its version counter, or None"};
PyMethodDef g_version_delta_def = {"version_delta", &version_delta, METH_O,
                                   "version_delta(handle) -> bumps of the counter since version_of"};
PyMethodDef g_version_final_def = {
    "version_final", &version_final, METH_O,
    "version_final(handle) -> version_delta once no tensor shares the counter, else None"};

void define_versions(py::module_& m) {
  if (g_version_type == nullptr) {
    g_version_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&g_version_spec));
    if (g_version_type == nullptr) throw py::error_already_set();
  }
  m.attr("version_of") = py::reinterpret_steal<py::object>(PyCFunction_New(&g_version_of_def, nullptr));
  m.attr("version_delta") =
      py::reinterpret_steal<py::object>(PyCFunction_New(&g_version_delta_def, nullptr));
  m.attr("version_final") =
      py::reinterpret_steal<py::object>(PyCFunction_New(&g_version_final_def, nullptr));
  m.def("set_lean_mode", [](bool on) { g_lean_mode.store(on); },
        "Level lean's function mode is on the traced thread's stack: the wrappers stand aside");
}


// --- level "lean": the copying API wrapped in C, no TorchFunctionMode ------------------------
// Instead of a mode that sees every torch call, each callable of the API table (Tensor.clone,
// torch.clone, Tensor.to, ...) is recorded by a C function exactly as the mode's handler does
// (call_through_recorded): torch's own pointers are hot-patched (hot_install, below), and the
// few callables with no C pointer (Tensor.__deepcopy__, Tensor.backward, Tensor.__getitem__)
// are replaced as attributes (wrap_api; data_descriptor for Tensor.data where its getset
// cannot be patched). A C function adds no Python frame; every other torch call runs
// untouched. Off the traced thread, outside tracing and inside a recorded call they call the
// original straight away.
std::atomic<bool> g_wrappers_on{false};
std::deque<PyMethodDef> g_wrap_defs;  // one per wrapper (its name); never freed
std::deque<std::string> g_wrap_names;
PyObject* g_data_get = nullptr;  // Tensor.data.__get__ / __set__ of the original descriptor
PyObject* g_data_set = nullptr;

// Code objects of torch's Python-level functions that a TorchFunctionMode sees as one call
// (they dispatch through handle_torch_function: torch.nn.functional's, Tensor.__repr__...).
// A mode's handler runs them with the mode off the stack, so it sees none of the torch calls
// they make; the wrappers stay quiet inside them too (their aten copies are implicit ones).
PyObject* g_quiet_codes = nullptr;  // a set

bool in_quiet_code() {
  if (g_quiet_codes == nullptr) return false;
  // The set's members by identity: hashing a code object hashes its whole contents (~2k
  // instructions per frame). The mirror holds the set, so its address is not reused.
  static PyObject* mirrored = nullptr;
  static Py_ssize_t mirrored_size = -1;
  static std::unordered_set<PyObject*> codes;
  if (mirrored != g_quiet_codes || PySet_GET_SIZE(g_quiet_codes) != mirrored_size) {
    codes.clear();
    Py_XDECREF(mirrored);
    mirrored = Py_NewRef(g_quiet_codes);
    mirrored_size = PySet_GET_SIZE(g_quiet_codes);
    PyObject* it = PyObject_GetIter(g_quiet_codes);
    for (PyObject* item = it ? PyIter_Next(it) : nullptr; item != nullptr; item = PyIter_Next(it)) {
      codes.insert(item);
      Py_DECREF(item);  // the set holds it
    }
    Py_XDECREF(it);
    if (PyErr_Occurred()) PyErr_Clear();
  }
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  bool quiet = false;
  while (frame != nullptr && !quiet) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    quiet = codes.count(reinterpret_cast<PyObject*>(code)) != 0;
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  if (PyErr_Occurred()) PyErr_Clear();
  return quiet;
}

inline bool wrappers_record() {
  // as a mode: nothing while torch function handling is off (torch's own internals,
  // copytrace's bookkeeping)
  // (and nothing while copytrace's mode is on the stack, set_lean_mode: it records instead,
  // as at level full)
  return g_wrappers_on.load(std::memory_order_relaxed) && tls_owner && !tls_folding &&
         tls_suppress == 0 && g_table != nullptr &&
         !g_lean_mode.load(std::memory_order_relaxed) &&
         at::impl::PythonTorchFunctionTLS::get_disabled_state() !=
             at::impl::TorchFunctionDisabledState::ALL_DISABLED;
}

PyObject* api_wrapper(PyObject* orig, PyObject* args, PyObject* kwargs) {
  if (!wrappers_record()) return PyObject_Call(orig, args, kwargs);
  return call_through_recorded(orig, args, kwargs, true);
}

struct DataDescr {
  PyObject_HEAD
  PyObject* orig;  // the original `data` getset descriptor of torch._C.TensorBase
};

PyObject* data_get(PyObject* self, PyObject* obj, PyObject* type) {
  PyObject* orig = reinterpret_cast<DataDescr*>(self)->orig;
  if (obj == nullptr || obj == Py_None || !wrappers_record() || g_data_get == nullptr)
    return Py_TYPE(orig)->tp_descr_get(orig, obj, type);
  PyObject* args = PyTuple_Pack(1, obj);
  if (args == nullptr) return nullptr;
  PyObject* r = call_through_recorded(g_data_get, args, nullptr, true);
  Py_DECREF(args);
  return r;
}

int data_set(PyObject* self, PyObject* obj, PyObject* value) {
  PyObject* orig = reinterpret_cast<DataDescr*>(self)->orig;
  if (value == nullptr || !wrappers_record() || g_data_set == nullptr)
    return Py_TYPE(orig)->tp_descr_set(orig, obj, value);
  PyObject* args = PyTuple_Pack(2, obj, value);
  if (args == nullptr) return -1;
  PyObject* r = call_through_recorded(g_data_set, args, nullptr, true);
  Py_DECREF(args);
  if (r == nullptr) return -1;
  Py_DECREF(r);
  return 0;
}

void data_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<DataDescr*>(self)->orig);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyType_Slot g_data_slots[] = {
    {Py_tp_descr_get, reinterpret_cast<void*>(&data_get)},
    {Py_tp_descr_set, reinterpret_cast<void*>(&data_set)},
    {Py_tp_dealloc, reinterpret_cast<void*>(&data_dealloc)},
    {Py_tp_doc, const_cast<char*>("Tensor.data, recorded while copytrace traces (level lean)")},
    {0, nullptr}};
PyType_Spec g_data_spec = {"copytrace_observer.DataDescriptor", sizeof(DataDescr), 0,
                           Py_TPFLAGS_DEFAULT, g_data_slots};

// A Tensor method's replacement on the class: read from an instance it is the wrapper bound to
// that instance; read from the class it is the original, so that torch (the `func` a mode or
// a subclass's __torch_function__ receives is looked up on the class), torch.overrides and
// the program see the same callables as untraced.
struct MethodDescr {
  PyObject_HEAD
  PyObject* orig;
  PyObject* wrapper;
};

PyObject* method_get(PyObject* self, PyObject* obj, PyObject*) {
  auto* d = reinterpret_cast<MethodDescr*>(self);
  if (obj == nullptr || obj == Py_None) {
    Py_INCREF(d->orig);
    return d->orig;
  }
  return PyMethod_New(d->wrapper, obj);
}

void method_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<MethodDescr*>(self)->orig);
  Py_XDECREF(reinterpret_cast<MethodDescr*>(self)->wrapper);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyType_Slot g_method_slots[] = {
    {Py_tp_descr_get, reinterpret_cast<void*>(&method_get)},
    {Py_tp_dealloc, reinterpret_cast<void*>(&method_dealloc)},
    {Py_tp_doc, const_cast<char*>("a Tensor method recorded while copytrace traces (lean)")},
    {0, nullptr}};
PyType_Spec g_method_spec = {"copytrace_observer.MethodDescriptor", sizeof(MethodDescr), 0,
                             Py_TPFLAGS_DEFAULT, g_method_slots};

// wrap_api(name, original, method) -> a C function named `name` calling `original` (see above);
// `method`: a MethodDescr for the Tensor class instead
py::object wrap_api(const std::string& name, py::object orig, bool method) {
  g_wrap_names.push_back(name);
  g_wrap_defs.push_back({g_wrap_names.back().c_str(),
                         reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&api_wrapper)),
                         METH_VARARGS | METH_KEYWORDS, "recorded by copytrace while it traces"});
  PyObject* fn = PyCFunction_New(&g_wrap_defs.back(), orig.ptr());
  if (fn == nullptr || !method) return py::reinterpret_steal<py::object>(fn);
  static PyObject* type = PyType_FromSpec(&g_method_spec);
  if (type == nullptr) {
    Py_DECREF(fn);
    throw py::error_already_set();
  }
  PyObject* self = PyType_GenericAlloc(reinterpret_cast<PyTypeObject*>(type), 0);
  if (self == nullptr) {
    Py_DECREF(fn);
    throw py::error_already_set();
  }
  reinterpret_cast<MethodDescr*>(self)->orig = orig.release().ptr();
  reinterpret_cast<MethodDescr*>(self)->wrapper = fn;
  return py::reinterpret_steal<py::object>(self);
}

// data_descriptor(original descriptor, original.__get__, original.__set__)
py::object data_descriptor(py::object orig, py::object getter, py::object setter) {
  static PyObject* type = PyType_FromSpec(&g_data_spec);
  if (type == nullptr) throw py::error_already_set();
  Py_XDECREF(g_data_get);
  Py_XDECREF(g_data_set);
  g_data_get = getter.release().ptr();
  g_data_set = setter.release().ptr();
  PyObject* self = PyType_GenericAlloc(reinterpret_cast<PyTypeObject*>(type), 0);
  if (self == nullptr) throw py::error_already_set();
  reinterpret_cast<DataDescr*>(self)->orig = orig.release().ptr();
  return py::reinterpret_steal<py::object>(self);
}


// --- level "lean": torch's own method tables hot-patched while tracing ----------------------
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

// hot_install(callables, data, get, set) -> [bool per callable, bool for data]: swap the
// pointers of every callable whose convention is handled (True) and, where `data` is
// Tensor.data's getset descriptor, its get/set (recorded as calls of `get`, `set`: its
// __get__, __set__, the API table's keys). Everything is checked before the first store; a
// second install first restores the previous one.
py::list hot_install(py::list callables, py::object data, py::object get, py::object set) {
  hot_restore();
  std::vector<HotSlot> slots;
  py::list done;
  for (py::handle item : callables) {
    PyObject* obj = item.ptr();
    HotSlot s;
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
    ok = ok && slots.size() < kHotSlots;
    if (ok) {
      s.key = Py_NewRef(obj);
      slots.push_back(s);
    }
    done.append(py::bool_(ok));
  }
  PyGetSetDef* getset = nullptr;
  if (!data.is_none() && !get.is_none() && !set.is_none() &&
      Py_IS_TYPE(data.ptr(), &PyGetSetDescr_Type)) {
    getset = reinterpret_cast<PyGetSetDescrObject*>(data.ptr())->d_getset;
    if (getset->get == nullptr || getset->set == nullptr || !writable(&getset->get))
      getset = nullptr;
  }
  done.append(py::bool_(getset != nullptr));
  // every check passed: the stores (none can fail)
  for (size_t i = 0; i < slots.size(); ++i) {
    HotSlot& s = g_hot[i];
    s = slots[i];
    if (s.kind == HotKind::kVcall) {
      s.installed_vcall = g_hot_vcall[i];
    } else {
      s.installed = s.kind == HotKind::kVarKw ? g_hot_varkw[i]
                    : s.kind == HotKind::kNoArgs ? g_hot_noargs[i] : g_hot_o[i];
    }
  }
  g_hot_count = slots.size();
  for (size_t i = 0; i < g_hot_count; ++i) {
    HotSlot& s = g_hot[i];
    if (s.kind == HotKind::kVcall) store_ptr(&s.fn->vectorcall, s.installed_vcall);
    else store_ptr(&s.def->ml_meth, s.installed);
  }
  if (getset != nullptr) {
    Py_XDECREF(g_data_get);
    Py_XDECREF(g_data_set);
    g_data_get = get.release().ptr();
    g_data_set = set.release().ptr();
    g_hot_get = getset->get;
    g_hot_set = getset->set;
    g_hot_getset = getset;
    store_ptr(&getset->get, static_cast<getter>(&hot_data_get));
    store_ptr(&getset->set, static_cast<setter>(&hot_data_set));
  }
  return done;
}

}  // namespace

namespace copytrace_facts {
void define(py::module_& m);  // tensor facts for the recorder (end of this file)
}  // namespace copytrace_facts

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "copytrace's dispatcher-level copy observer (BackendSelect kernels)";
  m.def("install", &install, "Register the kernels for the given (name, overload, kind) ops");
  m.def("uninstall", &uninstall, "Deregister every kernel and drop the callback");
  m.def("set_enabled", [](bool on) { g_on.store(on); });
  m.def("enabled", []() { return g_on.load(); });
  m.def("set_owner", [](bool owner) { tls_owner = owner; },
        "Mark the calling thread as the traced one (thread-local)");
  m.def("suppress", &suppress_region, "Enter a region the observer ignores (a compiled call)");
  m.def("unsuppress", &unsuppress_region);
  m.def("suppressed", []() { return tls_suppress; });
  m.def("begin_fold", []() {
    tls_fold.clear();
    tls_folding = true;
  });
  m.def("end_fold", &end_fold, "Stop folding; the aten names seen since begin_fold");
  m.def("internal_detaches", []() { return g_internal.exchange(0); },
        "Autograd's own detach/alias calls since the last call");
  m.def("errors", []() { return g_errors.exchange(0); });
  m.def("depth", []() { return tls_depth; }, "Ops in progress on this thread (debugging)");
  m.def("entry_frames", []() {
    py::tuple frames(tls_entry_frames.size());
    for (size_t i = 0; i < tls_entry_frames.size(); ++i)
      frames[i] = py::reinterpret_borrow<py::object>(tls_entry_frames[i]);
    return frames;
  }, "handle_torch_function frames copytrace's mode re-entered from, on this thread");
  m.def("has_entry_frames", []() { return !tls_entry_frames.empty(); });
  m.def("make_warn", [](py::object orig) {
    Py_XDECREF(g_orig_warn);
    g_orig_warn = orig.release().ptr();
    return py::reinterpret_steal<py::object>(PyCFunction_New(&g_warn_def, nullptr));
  }, "A warnings.warn that calls `orig` with the stacklevel counted as untraced");
  m.def("set_api_hooks", &set_api_hooks, "table, before, after, write_hook (None clears)");
  m.def("set_fast_events", &set_fast_events,
        "recorder, its FreshCopies, tail(op, src, out, ev, grad_fn, placed), op names "
        "(None clears)");
  m.def("set_fast_api", &set_fast_api,
        "op names, exact first-argument types, after(op, args, result, error, t0, t1, aten): "
        "the one-call path (None clears)");
  m.def("set_watch_writes", [](bool on) { g_watch_writes.store(on); });
  m.def("set_copy_hooks", &set_copy_hooks,
        "fresh (dict), written (dict), hook, Tensor.__getitem__ (None clears)");
  define_versions(m);  // version_of, version_delta, set_lean_mode
  m.def("wrap_api", &wrap_api, "A C function named `name` that records calls of `original` (method: binds as one)");
  m.def("data_descriptor", &data_descriptor,
        "A data descriptor for Tensor.data over (original, its __get__, its __set__)");
  m.def("set_wrappers", [](bool on) { g_wrappers_on.store(on); },
        "Record calls through the wrappers (level lean)");
  m.def("set_quiet_codes", [](py::object codes) {
    PyObject* old = g_quiet_codes;
    g_quiet_codes = codes.is_none() ? nullptr : codes.release().ptr();
    Py_XDECREF(old);
  }, "Code objects inside which the wrappers record nothing (a set; None clears)");
  m.def("hot_install", &hot_install,
        "Hot-patch torch's pointers of these callables and of Tensor.data's getset descriptor "
        "(data, its __get__, its __set__; or None): a bool per callable, then one for data");
  m.def("hot_restore", &hot_restore, "Put back every pointer hot_install swapped");
  m.def("hot_count", []() { return g_hot_count + (g_hot_getset != nullptr ? 1 : 0); },
        "How many entries are hot-patched now");
  // torch requires the handler's __self__ to be the mode object (python_arg_parser.cpp)
  m.def("bind_torch_function", [](py::object mode) {
    return py::reinterpret_steal<py::object>(PyCFunction_New(&g_tf_def, mode.ptr()));
  }, "The C __torch_function__ bound to `mode` (its __self__)");
  copytrace_facts::define(m);
}


// --- Tensor facts for the recorder, in one call ----------------------------------------------
// facts(t, with_grad_fn) reads what copytrace/tracer/_facts.py's Python reader read of a
// tensor (shape, dtype, device, autograd state, storage, view, version counter), from C++ and
// without re-entering torch's Python bindings. Only for plain tensors (torch.Tensor and
// nn.Parameter, strided, not nested, no symbolic sizes); for anything else it returns None and
// the Python readers decide. Never reads data, never syncs a device, keeps no reference.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Storage.h>
#include <structmember.h>
#include <torch/csrc/autograd/graph_task.h>
#include <cstring>

namespace copytrace_facts {

std::vector<PyObject*> g_dtype_names;                 // by ScalarType: "float32", ... (owned)
std::unordered_map<int32_t, PyObject*> g_device_names;  // by (type << 16 | index) (owned)

PyObject* dtype_name(at::ScalarType st) {
  const auto i = static_cast<size_t>(st);
  if (i >= g_dtype_names.size()) g_dtype_names.resize(i + 1, nullptr);
  PyObject*& slot = g_dtype_names[i];
  if (slot == nullptr) {
    // str(torch.float32) is "torch.float32": the name the Python reader keeps
    PyObject* text = PyObject_Str(reinterpret_cast<PyObject*>(torch::getTHPDtype(st)));
    if (text == nullptr) return nullptr;
    std::string s = PyUnicode_AsUTF8(text);
    Py_DECREF(text);
    if (s.rfind("torch.", 0) == 0) s = s.substr(6);
    slot = PyUnicode_InternFromString(s.c_str());
    if (slot == nullptr) return nullptr;
  }
  Py_INCREF(slot);
  return slot;
}

PyObject* device_name(const c10::Device& d) {
  const int32_t key = (static_cast<int32_t>(d.type()) << 16) | (d.index() & 0xffff);
  auto found = g_device_names.find(key);
  if (found == g_device_names.end()) {
    PyObject* name = PyUnicode_InternFromString(d.str().c_str());  // as str(torch.device)
    if (name == nullptr) return nullptr;
    found = g_device_names.emplace(key, name).first;
  }
  Py_INCREF(found->second);
  return found->second;
}

PyObject* int_tuple(c10::IntArrayRef values) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
  }
  return out;
}

inline PyObject* new_bool(bool v) { return Py_NewRef(v ? Py_True : Py_False); }

// (shape, dtype, device, requires_grad, is_leaf, grad_fn, grad_fn name, storage, storage bytes,
//  logical bytes, storage offset, strides, version or None, is_meta); is_leaf, grad_fn, its
//  name and is_meta only with with_grad_fn (else None, None, None, False).
//  See copytrace/tracer/_facts.py.
PyObject* facts(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs < 1 || !THPVariable_CheckExact(argv[0])) Py_RETURN_NONE;
  const bool with_grad_fn = nargs > 1 && PyObject_IsTrue(argv[1]) == 1;
  PyObject* items[14] = {nullptr};
  try {
    const at::Tensor& t = THPVariable_Unpack(argv[0]);
    if (!t.defined() || t.layout() != c10::kStrided || t.is_nested()) Py_RETURN_NONE;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->has_symbolic_sizes_strides() || !impl->has_storage()) Py_RETURN_NONE;
    const c10::Storage& storage = impl->storage();
    if (storage.unsafeGetStorageImpl() == nullptr) Py_RETURN_NONE;
    const c10::SymInt sym_bytes = storage.sym_nbytes();
    if (sym_bytes.is_heap_allocated()) Py_RETURN_NONE;
    const int64_t storage_bytes = sym_bytes.as_int_unchecked();
    const int64_t logical = t.numel() * static_cast<int64_t>(t.element_size());
    items[0] = int_tuple(t.sizes());
    items[1] = dtype_name(t.scalar_type());
    items[2] = device_name(t.device());
    items[3] = new_bool(t.requires_grad());
    if (with_grad_fn) {
      // grad_fn() may regenerate a view's node: read only where the Python reader reads it
      const auto& grad_fn = t.grad_fn();
      items[4] = new_bool(!grad_fn);
      if (grad_fn) {
        items[5] = torch::autograd::functionToPyObject(grad_fn);
        if (items[5] != nullptr) items[6] = PyType_GetName(Py_TYPE(items[5]));
      } else {
        items[5] = Py_NewRef(Py_None);
        items[6] = Py_NewRef(Py_None);
      }
    } else {
      items[4] = Py_NewRef(Py_None);
      items[5] = Py_NewRef(Py_None);
      items[6] = Py_NewRef(Py_None);
    }
    items[7] = THPStorage_Wrap(storage);
    items[8] = PyLong_FromLongLong(storage_bytes);
    items[9] = PyLong_FromLongLong(logical);
    items[10] = PyLong_FromLongLong(t.storage_offset());
    items[11] = int_tuple(t.strides());
    items[12] = t.is_inference() ? Py_NewRef(Py_None) : PyLong_FromLongLong(t._version());
    items[13] = new_bool(with_grad_fn && t.is_meta());
  } catch (const std::exception&) {
    for (PyObject* item : items) Py_XDECREF(item);
    PyErr_Clear();
    Py_RETURN_NONE;  // let the Python readers decide
  }
  for (PyObject* item : items) {
    if (item == nullptr) {
      for (PyObject* other : items) Py_XDECREF(other);
      if (PyErr_Occurred()) PyErr_Clear();
      Py_RETURN_NONE;
    }
  }
  PyObject* out = PyTuple_New(14);
  if (out == nullptr) {
    for (PyObject* item : items) Py_DECREF(item);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < 14; ++i) PyTuple_SET_ITEM(out, i, items[i]);
  return out;
}

PyMethodDef g_facts_def = {"facts", reinterpret_cast<PyCFunction>(
                               reinterpret_cast<void (*)()>(&facts)),
                           METH_FASTCALL,
                           "facts(t, with_grad_fn=False): a plain tensor's facts as one tuple "
                           "(see copytrace/tracer/_facts.py), or None"};

// copy_slots(proto): a new object of proto's type whose __slots__ hold proto's values (a
// shallow copy, about 10x cheaper than CopyEvent's 51-field __init__), not tracked by the
// cycle collector: an event holds only strings, numbers and tuples of them, so it can be in no
// reference cycle, and a trace keeps up to a million of them alive.
PyObject* copy_slots(PyObject*, PyObject* proto) {
  PyTypeObject* type = Py_TYPE(proto);
  if (!(type->tp_flags & Py_TPFLAGS_HEAPTYPE) || type->tp_members == nullptr ||
      type->tp_dictoffset != 0) {
    PyErr_SetString(PyExc_TypeError, "copy_slots: an instance of a class with __slots__");
    return nullptr;
  }
  PyObject* out = type->tp_alloc(type, 0);
  if (out == nullptr) return nullptr;
  for (PyMemberDef* member = type->tp_members; member->name != nullptr; ++member) {
    if (member->type != T_OBJECT_EX) continue;
    PyObject* value = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(proto) +
                                                    member->offset);
    Py_XINCREF(value);
    *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(out) + member->offset) = value;
  }
  if (PyObject_GC_IsTracked(out)) PyObject_GC_UnTrack(out);
  return out;
}

PyMethodDef g_copy_slots_def = {"copy_slots", &copy_slots, METH_O,
                                "copy_slots(proto): a shallow copy of a __slots__ object "
                                "(a new CopyEvent from a prototype), untracked by the GC"};

// call_site(classify): (file, line, function, via) of the innermost user-code frame on the
// calling thread's stack, as copytrace/tracer/_callsite.py's user_frame() finds it, or None.
// classify(code) gives a code object's kind (0 user, 1 torch or an installed package,
// 2 copytrace or the stdlib, 3 a mode's handler), kept per code object (by identity: hashing a
// code object hashes its whole contents). The user
// frame's (file, line, function) is cached per (code object, instruction): a line number is
// otherwise a scan of the code's line table. The cache holds its code objects (never frames).
struct SiteKey {
  PyObject* code;
  int lasti;
  bool operator==(const SiteKey& o) const { return code == o.code && lasti == o.lasti; }
};
struct SiteKeyHash {
  size_t operator()(const SiteKey& k) const {
    return std::hash<void*>()(k.code) ^ (std::hash<int>()(k.lasti) * 31);
  }
};
std::unordered_map<SiteKey, PyObject*, SiteKeyHash> g_sites;  // -> (file, line, name), owned
std::unordered_map<PyObject*, int> g_kinds;  // code object (owned) -> kind
constexpr size_t kMaxSites = 1 << 16;

void clear_sites() {
  for (auto& [key, site] : g_sites) {
    Py_DECREF(key.code);
    Py_DECREF(site);
  }
  g_sites.clear();
  for (auto& [code, kind] : g_kinds) Py_DECREF(code);
  g_kinds.clear();
}

PyObject* user_site(PyFrameObject* frame, PyCodeObject* code) {
  const SiteKey key{reinterpret_cast<PyObject*>(code), PyFrame_GetLasti(frame)};
  auto found = g_sites.find(key);
  if (found != g_sites.end()) return Py_NewRef(found->second);
  PyObject* site = Py_BuildValue("(OiO)", code->co_filename, PyFrame_GetLineNumber(frame),
                                 code->co_name);
  if (site == nullptr) return nullptr;
  if (g_sites.size() >= kMaxSites) clear_sites();
  Py_INCREF(key.code);
  g_sites.emplace(key, Py_NewRef(site));
  return site;
}

PyObject* call_site(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "call_site(classify)");
    return nullptr;
  }
  PyObject* via = nullptr;  // borrowed from a code object we hold while walking
  PyObject* result = nullptr;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  std::vector<PyCodeObject*> held;  // codes whose qualname `via` may borrow
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    long kind;
    auto known = g_kinds.find(reinterpret_cast<PyObject*>(code));
    if (known != g_kinds.end()) {
      kind = known->second;
    } else {
      PyObject* k = PyObject_CallOneArg(argv[0], reinterpret_cast<PyObject*>(code));
      kind = k != nullptr ? PyLong_AsLong(k) : -1;
      Py_XDECREF(k);
      if (kind == -1 && PyErr_Occurred()) {
        Py_DECREF(code);
        break;
      }
      if (g_kinds.size() >= kMaxSites) clear_sites();
      Py_INCREF(code);  // held by the map: its address is not reused while there
      g_kinds.emplace(reinterpret_cast<PyObject*>(code), static_cast<int>(kind));
    }
    if (kind == 0) {
      PyObject* site = user_site(frame, code);
      if (site != nullptr) {
        result = PyTuple_Pack(4, PyTuple_GET_ITEM(site, 0), PyTuple_GET_ITEM(site, 1),
                              PyTuple_GET_ITEM(site, 2), via != nullptr ? via : Py_None);
        Py_DECREF(site);
      }
      Py_DECREF(code);
      break;
    }
    if (kind == 1 && via == nullptr) {
      via = code->co_qualname;
      held.push_back(code);
    } else {
      Py_DECREF(code);
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  if (result == nullptr && !PyErr_Occurred()) {
    if (frame == nullptr) result = Py_NewRef(Py_None);  // no user frame on the stack
  }
  Py_XDECREF(frame);
  for (PyCodeObject* code : held) Py_DECREF(code);
  return result;
}

PyMethodDef g_call_site_def = {"call_site", reinterpret_cast<PyCFunction>(
                                   reinterpret_cast<void (*)()>(&call_site)),
                               METH_FASTCALL,
                               "call_site(classify): the user's (file, line, function, "
                               "via) or None (see copytrace/tracer/_callsite.py)"};

// record(state, op, src, out, src_requires_grad, seq, start, end, aten, step, in_optimizer):
// the common case
// of Recorder._record_api (copytrace/tracer/_recorder.py) in one call: a new event with its
// tensor facts, call site and storage ids, for an API call on plain tensors that did not
// raise (the caller leaves numpy, deepcopy and calls inside a deepcopy group to Python).
// state: (prototype event, Watch.ids (StorageIds), call-site classify, Module._call_impl's code,
// the recorder's thread names by ident). Returns (event, result's grad_fn or None, where): where
// is True when the event's phase, module and thread are set too (outside backward, no module
// call in progress, a thread named before), else the innermost Module._call_impl frame or None
// for Recorder._place; False
// when the call is no event (a zero-dim integer index: a view); None when a tensor is not a
// plain one (the caller records it with the Python readers). Sets exactly the fields the Python
// path sets, in the same order of storage ids (input, then result).
enum Field {
  F_SEQ, F_OP, F_ATEN, F_BYTES_ALLOCATED, F_BYTES_LOGICAL, F_ALIAS, F_NOOP, F_SHAPE, F_DTYPE,
  F_SRC_DTYPE, F_SRC_DEVICE, F_DST_DEVICE, F_TRANSFER, F_REQUIRES_GRAD, F_SRC_REQUIRES_GRAD,
  F_GRAD_FN, F_IS_LEAF, F_GRAPH, F_STEP, F_FILE, F_LINE, F_FUNCTION, F_VIA, F_START_NS,
  F_END_NS, F_PINNED, F_SRC_STORAGE, F_SRC_OFFSET, F_SRC_STRIDE, F_SRC_VERSION, F_DST_STORAGE,
  F_DST_VERSION, F_FAKE, F_PHASE, F_THREAD_ID, F_THREAD_NAME, F_COUNT
};
const char* const kFieldNames[F_COUNT] = {
    "seq", "op", "aten", "bytes_allocated", "bytes_logical", "alias", "noop", "shape", "dtype",
    "src_dtype", "src_device", "dst_device", "transfer", "requires_grad", "src_requires_grad",
    "grad_fn", "is_leaf", "graph", "step", "file", "line", "function", "via", "start_ns",
    "end_ns", "pinned", "src_storage", "src_offset", "src_stride", "src_version", "dst_storage",
    "dst_version", "fake", "phase", "thread_id", "thread_name"};
PyTypeObject* g_event_type = nullptr;  // the type g_offsets belong to (borrowed, compared only)
Py_ssize_t g_offsets[F_COUNT];
// interned strings: op names compared, values stored, attribute names read
PyObject *s_copy_, *s_index, *s_attached, *s_detached, *s_h2d, *s_d2h, *s_d2d, *s_cpu, *s_ids,
    *s_next, *s_limit, *s_of_storage, *s_is_pinned, *s_optimizer, *s_other;
PyObject* g_always_alias = nullptr;  // frozenset of op names whose result is an alias

bool record_setup(PyTypeObject* type) {
  if (s_copy_ == nullptr) {
    struct { PyObject** slot; const char* text; } names[] = {
        {&s_copy_, "copy_"}, {&s_index, "index"}, {&s_attached, "attached"},
        {&s_detached, "detached"}, {&s_h2d, "h2d"}, {&s_d2h, "d2h"}, {&s_d2d, "d2d"},
        {&s_cpu, "cpu"}, {&s_ids, "_ids"}, {&s_next, "_next"}, {&s_limit, "_limit"},
        {&s_of_storage, "of_storage"}, {&s_is_pinned, "is_pinned"},
        {&s_optimizer, "optimizer"}, {&s_other, "other"}};
    for (auto& n : names) {
      *n.slot = PyUnicode_InternFromString(n.text);
      if (*n.slot == nullptr) return false;
    }
    // _recorder._ALWAYS_ALIAS
    PyObject* list = Py_BuildValue("[ssssss]", "detach", "detach_", "data_get", "numpy", "copy",
                                   "swap_tensors");
    if (list == nullptr) return false;
    g_always_alias = PyFrozenSet_New(list);
    Py_DECREF(list);
    if (g_always_alias == nullptr) return false;
  }
  if (type == g_event_type) return true;
  if (type->tp_members == nullptr || type->tp_dictoffset != 0) {
    PyErr_SetString(PyExc_TypeError, "record: the prototype's class must have __slots__");
    return false;
  }
  for (int f = 0; f < F_COUNT; ++f) {
    g_offsets[f] = -1;
    for (PyMemberDef* m = type->tp_members; m->name != nullptr; ++m) {
      if (m->type == T_OBJECT_EX && std::strcmp(m->name, kFieldNames[f]) == 0) {
        g_offsets[f] = m->offset;
        break;
      }
    }
    if (g_offsets[f] < 0) {
      PyErr_Format(PyExc_TypeError, "record: the event has no field %s", kFieldNames[f]);
      return false;
    }
  }
  g_event_type = type;
  return true;
}

// Store `value` (a new reference, may be NULL after an error: then false) in field f of ev.
inline bool put(PyObject* ev, Field f, PyObject* value) {
  if (value == nullptr) return false;
  PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(ev) + g_offsets[f]);
  PyObject* old = *slot;
  *slot = value;
  Py_XDECREF(old);
  return true;
}

inline bool same_op(PyObject* op, PyObject* name) {
  return op == name || (PyUnicode_Check(op) && PyUnicode_Compare(op, name) == 0);
}

// _recorder._transfer(src, dst) for two different device names
PyObject* transfer_of(PyObject* src, PyObject* dst) {
  if (PyUnicode_Compare(src, dst) == 0) return PyUnicode_InternFromString("none");
  const bool src_host = PyUnicode_Compare(src, s_cpu) == 0;
  const bool dst_host = PyUnicode_Compare(dst, s_cpu) == 0;
  if (src_host && !dst_host) return Py_NewRef(s_h2d);
  if (dst_host && !src_host) return Py_NewRef(s_d2h);
  if (src_host && dst_host) return PyUnicode_InternFromString("none");
  return Py_NewRef(s_d2d);
}

// StorageIds.of_storage(storage) (copytrace/tracer/_watch.py): its dict read and its insert
// in C; a full table (to be pruned) goes to the Python method.
PyObject* storage_id(PyObject* ids, PyObject* storage) {
  PyObject* table = PyObject_GetAttr(ids, s_ids);
  if (table == nullptr) return nullptr;
  PyObject* key = PyLong_FromVoidPtr(storage);  // id(storage)
  if (key == nullptr || !PyDict_Check(table)) {
    Py_DECREF(table);
    Py_XDECREF(key);
    return key == nullptr ? nullptr : PyObject_CallMethodOneArg(ids, s_of_storage, storage);
  }
  PyObject* entry = PyDict_GetItemWithError(table, key);  // borrowed
  if (entry != nullptr && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2 &&
      PyWeakref_Check(PyTuple_GET_ITEM(entry, 0)) &&
      PyWeakref_GET_OBJECT(PyTuple_GET_ITEM(entry, 0)) == storage) {
    PyObject* uid = Py_NewRef(PyTuple_GET_ITEM(entry, 1));
    Py_DECREF(key);
    Py_DECREF(table);
    return uid;
  }
  PyObject* result = nullptr;
  PyObject* limit = PyErr_Occurred() ? nullptr : PyObject_GetAttr(ids, s_limit);
  PyObject* uid = limit == nullptr ? nullptr : PyObject_GetAttr(ids, s_next);
  if (uid != nullptr) {
    const Py_ssize_t size = PyDict_GET_SIZE(table);
    const long long lim = PyLong_AsLongLong(limit);
    if (lim == -1 && PyErr_Occurred()) {
      // result stays NULL
    } else if (size >= lim) {
      result = PyObject_CallMethodOneArg(ids, s_of_storage, storage);  // prunes the table
    } else {
      PyObject* one = PyLong_FromLong(1);
      PyObject* next = one == nullptr ? nullptr : PyNumber_Add(uid, one);
      Py_XDECREF(one);
      PyObject* ref = next == nullptr ? nullptr : PyWeakref_NewRef(storage, nullptr);
      PyObject* value = ref == nullptr ? nullptr : PyTuple_Pack(2, ref, uid);
      Py_XDECREF(ref);
      if (value != nullptr && PyObject_SetAttr(ids, s_next, next) == 0 &&
          PyDict_SetItem(table, key, value) == 0) {
        result = Py_NewRef(uid);
      }
      Py_XDECREF(next);
      Py_XDECREF(value);
    }
  }
  Py_XDECREF(uid);
  Py_XDECREF(limit);
  Py_DECREF(key);
  Py_DECREF(table);
  return result;
}

PyObject* call_site(PyObject*, PyObject* const* argv, Py_ssize_t nargs);
PyObject* facts(PyObject*, PyObject* const* argv, Py_ssize_t nargs);
PyObject* copy_slots(PyObject*, PyObject* proto);

// The innermost frame running `code` (Module._call_impl) on this thread's stack, or None.
PyObject* innermost_frame_of(PyObject* code) {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* c = PyFrame_GetCode(frame);  // new reference
    const bool found = reinterpret_cast<PyObject*>(c) == code;
    Py_DECREF(c);
    if (found) return reinterpret_cast<PyObject*>(frame);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_RETURN_NONE;
}

PyObject* record(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 11 || !PyTuple_Check(argv[0]) || PyTuple_GET_SIZE(argv[0]) != 5) {
    PyErr_SetString(PyExc_TypeError,
                    "record(state, op, src, out, src_requires_grad, seq, start, end, aten, step, "
                    "in_optimizer)");
    return nullptr;
  }
  PyObject* state = argv[0];
  PyObject *op = argv[1], *src = argv[2], *out = argv[3], *src_rg_arg = argv[4];
  PyObject* proto = PyTuple_GET_ITEM(state, 0);
  PyObject* ids = PyTuple_GET_ITEM(state, 1);
  if (!THPVariable_CheckExact(src) || !THPVariable_CheckExact(out)) Py_RETURN_NONE;
  if (!record_setup(Py_TYPE(proto))) return nullptr;
  PyObject* fs_args[2] = {src, Py_False};
  PyObject* fs = facts(nullptr, fs_args, 2);
  if (fs == nullptr || fs == Py_None) return fs;
  PyObject* fo_args[2] = {out, Py_True};
  PyObject* fo = facts(nullptr, fo_args, 2);
  if (fo == nullptr || fo == Py_None) {
    Py_DECREF(fs);
    return fo;
  }
  struct Drop {
    PyObject* objs[3];
    ~Drop() { for (PyObject* o : objs) Py_XDECREF(o); }
  } drop{{fs, fo, nullptr}};
  auto S = [&](int i) { return PyTuple_GET_ITEM(fs, i); };
  auto O = [&](int i) { return PyTuple_GET_ITEM(fo, i); };
  PyObject* ev = copy_slots(nullptr, proto);
  if (ev == nullptr) return nullptr;
  drop.objs[2] = ev;
  auto R = [](PyObject* o) { return Py_NewRef(o); };
  bool ok = put(ev, F_OP, R(op)) && put(ev, F_ATEN, R(argv[8])) && put(ev, F_SEQ, R(argv[5])) &&
            put(ev, F_START_NS, R(argv[6])) && put(ev, F_END_NS, R(argv[7]));
  PyObject* src_device = S(2);
  PyObject* src_rg = src_rg_arg == Py_None ? S(3) : src_rg_arg;
  PyObject* dst_device = O(2);
  PyObject* rg = O(3);
  PyObject* grad_fn = O(5);
  ok = ok && put(ev, F_SRC_DTYPE, R(S(1))) && put(ev, F_SRC_DEVICE, R(src_device)) &&
       put(ev, F_SRC_REQUIRES_GRAD, R(src_rg)) && put(ev, F_SHAPE, R(O(0))) &&
       put(ev, F_DTYPE, R(O(1))) && put(ev, F_DST_DEVICE, R(dst_device)) &&
       put(ev, F_BYTES_LOGICAL, R(O(9))) && put(ev, F_REQUIRES_GRAD, R(rg)) &&
       put(ev, F_GRAD_FN, R(O(6))) && put(ev, F_IS_LEAF, R(O(4)));
  if (!ok) return nullptr;
  bool noop = false, alias = false;
  if (same_op(op, s_copy_)) {
    alias = false;  // written into an existing tensor: 0 bytes allocated
  } else if (out == src) {
    noop = alias = true;
    ok = put(ev, F_NOOP, R(Py_True)) && put(ev, F_ALIAS, R(Py_True));
  } else {
    const int always = PySet_Contains(g_always_alias, op);
    if (always < 0) return nullptr;
    if (always == 1) {
      alias = true;
    } else {
      PyObject* storage = O(7);
      PyObject* src_storage = S(7);
      alias = storage != Py_None && src_storage != Py_None &&
              (storage == src_storage ||
               THPStorage_Unpack(storage).unsafeGetStorageImpl() ==
                   THPStorage_Unpack(src_storage).unsafeGetStorageImpl());
    }
    ok = put(ev, F_ALIAS, R(alias ? Py_True : Py_False));
    if (ok && !alias) {
      if (O(13) == Py_True) {
        ok = put(ev, F_FAKE, R(Py_True));  // a copy of no real memory: logical bytes only
      } else {
        ok = put(ev, F_BYTES_ALLOCATED, R(O(8)));
      }
    }
  }
  if (!ok) return nullptr;
  if (grad_fn != Py_None || (noop && rg == Py_True)) {
    ok = put(ev, F_GRAPH, R(s_attached));
  } else if (src_rg == Py_True) {
    ok = put(ev, F_GRAPH, R(s_detached));
  }
  if (!ok) return nullptr;
  if (alias && same_op(op, s_index)) Py_RETURN_FALSE;  // a zero-dim integer index: a view
  if (src_device != dst_device) {  // interned names: equal names are one object
    PyObject* transfer = transfer_of(src_device, dst_device);
    if (!put(ev, F_TRANSFER, transfer)) return nullptr;
    if (transfer == s_h2d) {
      PyObject* pinned = PyObject_CallMethodNoArgs(src, s_is_pinned);
      if (!put(ev, F_PINNED, pinned)) return nullptr;
    }
  }
  // Recorder._context's call site
  PyObject* classify = PyTuple_GET_ITEM(state, 2);
  PyObject* site = call_site(nullptr, &classify, 1);
  if (site == nullptr) return nullptr;
  if (site != Py_None) {
    ok = put(ev, F_FILE, R(PyTuple_GET_ITEM(site, 0))) &&
         put(ev, F_LINE, R(PyTuple_GET_ITEM(site, 1))) &&
         put(ev, F_FUNCTION, R(PyTuple_GET_ITEM(site, 2))) &&
         put(ev, F_VIA, R(PyTuple_GET_ITEM(site, 3)));
  }
  Py_DECREF(site);
  if (!ok || !put(ev, F_STEP, R(argv[9]))) return nullptr;
  // Watch._event's storage facts
  PyObject* sid = storage_id(ids, S(7));
  if (!put(ev, F_SRC_STORAGE, sid)) return nullptr;
  if (S(10) != Py_None) {
    ok = put(ev, F_SRC_OFFSET, R(S(10))) && put(ev, F_SRC_STRIDE, R(S(11))) &&
         put(ev, F_SRC_VERSION, R(S(12)));
  }
  if (ok) {
    ok = put(ev, F_DST_STORAGE, out == src ? R(sid) : storage_id(ids, O(7))) &&
         put(ev, F_DST_VERSION, R(O(12)));
  }
  if (!ok) return nullptr;
  PyObject* frame = innermost_frame_of(PyTuple_GET_ITEM(state, 3));
  if (frame == nullptr) return nullptr;
  if (frame == Py_None && torch::autograd::get_current_graph_task_id() < 0) {
    // Recorder._place's common case: not in backward, no module call: module None
    PyObject* ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (ident == nullptr) {
      Py_DECREF(frame);
      return nullptr;
    }
    PyObject* name = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, 4), ident);  // borrowed
    if (name != nullptr) {
      const int optimizer = PyObject_IsTrue(argv[10]);
      if (optimizer < 0 || !put(ev, F_PHASE, R(optimizer ? s_optimizer : s_other)) ||
          !put(ev, F_THREAD_NAME, R(name))) {
        Py_DECREF(ident);
        Py_DECREF(frame);
        return nullptr;
      }
      put(ev, F_THREAD_ID, ident);  // takes the reference
      ident = nullptr;
      Py_DECREF(frame);
      frame = Py_NewRef(Py_True);
    }
    Py_XDECREF(ident);
    if (PyErr_Occurred()) {
      Py_DECREF(frame);
      return nullptr;
    }
  }
  PyObject* result = PyTuple_New(3);
  if (result == nullptr) {
    Py_DECREF(frame);
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 0, R(ev));
  PyTuple_SET_ITEM(result, 1, R(grad_fn));
  PyTuple_SET_ITEM(result, 2, frame);
  return result;
}

PyMethodDef g_record_def = {"record", reinterpret_cast<PyCFunction>(
                                reinterpret_cast<void (*)()>(&record)),
                            METH_FASTCALL,
                            "record(state, op, src, out, src_requires_grad, seq, start, end, "
                            "aten, step, in_optimizer): an API call's event as (event, grad_fn, "
                            "placed or module frame), False or None (see observer.cpp)"};

// frame_var(frame, name): the value of a running frame's local, cell or free variable
// `name`, without building the frame's f_locals dict (which copies every variable, at every
// compiled call: copytrace reads torch.compile's wrapper's `fn` this way); NameError when the
// frame has no such variable bound. Python 3.12+: PyFrame_GetVar; 3.11: the interpreter
// frame's localsplus array (Include/internal/pycore_frame.h), cells read through; older: f_locals.
PyObject* frame_var_of(PyFrameObject* frame, PyObject* name) {
#if PY_VERSION_HEX >= 0x030C0000
  return PyFrame_GetVar(frame, name);
#elif PY_VERSION_HEX >= 0x030B0000
  _PyInterpreterFrame* fr = frame->f_frame;
  PyCodeObject* co = fr->f_code;
  PyObject* names = co->co_localsplusnames;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); ++i) {
    PyObject* n = PyTuple_GET_ITEM(names, i);
    if (n != name && PyUnicode_Compare(n, name) != 0) continue;
    PyObject* value = fr->localsplus[i];
    const _PyLocals_Kind kind = _PyLocals_GetKind(co->co_localspluskinds, static_cast<int>(i));
    if (value != nullptr && (kind & (CO_FAST_CELL | CO_FAST_FREE)) && PyCell_Check(value))
      value = PyCell_GET(value);
    if (value == nullptr) break;
    Py_INCREF(value);
    return value;
  }
  PyErr_Format(PyExc_NameError, "variable %R does not exist", name);
  return nullptr;
#else
  // older Pythons: through f_locals (a dict of every variable, built for this read)
  PyObject* locals = PyObject_GetAttrString(reinterpret_cast<PyObject*>(frame), "f_locals");
  if (locals == nullptr) return nullptr;
  PyObject* value = PyObject_GetItem(locals, name);
  Py_DECREF(locals);
  if (value == nullptr && PyErr_ExceptionMatches(PyExc_KeyError)) {
    PyErr_Clear();
    PyErr_Format(PyExc_NameError, "variable %R does not exist", name);
  }
  return value;
#endif
}

PyObject* frame_var(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 2 || !PyFrame_Check(argv[0]) || !PyUnicode_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "frame_var(frame, name)");
    return nullptr;
  }
  return frame_var_of(reinterpret_cast<PyFrameObject*>(argv[0]), argv[1]);
}

// --- compiled calls: torch._dynamo.eval_frame._callback_from_stance, in C ---------------------
// Called with None by the torch._dynamo.disable wrapper of every compiled graph as the graph
// runs, and with the context's callback by compile_wrapper as a compiled call starts. While
// copytrace's compiled-call hook has a call open (cc_begin, on the traced thread), the None
// case appends the code of the frame that called the wrapper (a dynamo graph's generated code)
// to the call's list; the other case hands a callback that dynamo may call (a frame to
// compile) to copytrace's wrapper (Compiled._wrapped), the last pair kept. Everything then goes
// to torch's own function, so the stance is applied as untraced.
PyObject* g_cfs_orig = nullptr;    // torch's _callback_from_stance
PyObject* g_cfs_state = nullptr;   // the Compiled object (depth, sticky)
PyObject* g_cfs_wrap = nullptr;    // Compiled._wrapped
PyObject* g_cfs_codes = nullptr;   // the open call's graph codes (a list), or null
PyObject* g_cfs_last[2] = {nullptr, nullptr};  // (callback, its wrapper)
thread_local bool tls_cfs_thread = false;

void cfs_clear_last() {
  Py_CLEAR(g_cfs_last[0]);
  Py_CLEAR(g_cfs_last[1]);
}

PyObject* cfs(PyObject*, PyObject* callback) {
  if (g_cfs_orig == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "copytrace's _callback_from_stance is not installed");
    return nullptr;
  }
  if (callback == Py_None) {
    if (g_cfs_codes != nullptr && tls_cfs_thread) {
      PyFrameObject* wrapper = PyEval_GetFrame();  // borrowed: the disable wrapper's frame
      PyFrameObject* graph = wrapper != nullptr ? PyFrame_GetBack(wrapper) : nullptr;  // new
      if (graph != nullptr) {
        PyCodeObject* code = PyFrame_GetCode(graph);  // new reference
        if (PyList_Append(g_cfs_codes, reinterpret_cast<PyObject*>(code)) < 0) swallow();
        Py_DECREF(code);
        Py_DECREF(graph);
      }
    }
    return PyObject_CallOneArg(g_cfs_orig, callback);
  }
  PyObject* out = PyObject_CallOneArg(g_cfs_orig, callback);
  if (out == nullptr || out == Py_None || out == Py_False || g_cfs_state == nullptr ||
      g_cfs_wrap == nullptr || !tls_cfs_thread)
    return out;
  PyObject* depth = PyObject_GetAttrString(g_cfs_state, "depth");
  PyObject* sticky = PyObject_GetAttrString(g_cfs_state, "sticky");
  const bool wrap = depth != nullptr && sticky != nullptr && PyObject_IsTrue(depth) == 1 &&
                    PyObject_IsTrue(sticky) == 0;
  Py_XDECREF(depth);
  Py_XDECREF(sticky);
  if (PyErr_Occurred()) swallow();
  if (!wrap) return out;
  if (out == g_cfs_last[0]) {
    Py_DECREF(out);
    Py_INCREF(g_cfs_last[1]);
    return g_cfs_last[1];
  }
  PyObject* wrapped = PyObject_CallOneArg(g_cfs_wrap, out);
  if (wrapped == nullptr) {
    swallow();
    return out;  // unwrapped: dynamo still works, copytrace does not step aside for it
  }
  cfs_clear_last();
  g_cfs_last[0] = out;  // the reference `out` held
  Py_INCREF(wrapped);
  g_cfs_last[1] = wrapped;
  return wrapped;
}

// cfs_install(orig, state, wrap) on the traced thread; cfs_install(None, None, None) clears.
void cfs_install(py::object orig, py::object state, py::object wrap) {
  cfs_clear_last();
  Py_CLEAR(g_cfs_codes);
  tls_cfs_thread = !orig.is_none();
  set_slot(g_cfs_orig, orig);
  set_slot(g_cfs_state, state);
  set_slot(g_cfs_wrap, wrap);
}

// cfs_begin(list) as a compiled call starts (the list collects its graphs' codes), None at its
// end.
void cfs_begin(py::object codes) {
  PyObject* old = g_cfs_codes;
  g_cfs_codes = codes.is_none() ? nullptr : codes.release().ptr();
  Py_XDECREF(old);
}

PyMethodDef g_cfs_def = {"callback_from_stance", reinterpret_cast<PyCFunction>(
                             reinterpret_cast<void (*)()>(&cfs)),
                         METH_O, "copytrace's torch._dynamo.eval_frame._callback_from_stance"};

// --- compiled calls: the enter/exit hook, in C --------------------------------------------------
// compiled_enter is the hook copytrace adds to every torch.compile context's enter_exit_hooks
// (copytrace/tracer/_compiled.py). The common call (the traced thread, not nested, no mode on
// torch's stacks, no guard reading a patched name) is handled here: depth 1 on the Compiled
// object and the recorder, the observer suppressed, the start time, the step, the compiled
// callable's source (from the wrapper's `fn`, through Compiled._sources), and the list the
// graphs' codes go to (cfs). compiled_leave records the call as one tuple in Compiled._raw
// (graph ids from Compiled._code_graphs, graph_runs counted, the graphs' copies summed), the
// same tuple Compiled._leave makes. Any other call goes to Compiled.enter (Python).
struct CompiledHook {
  PyObject* state = nullptr;        // the Compiled object
  PyObject* rec = nullptr;          // its Recorder
  PyObject* raw = nullptr;          // Compiled._raw
  PyObject* code_graphs = nullptr;  // Compiled._code_graphs: code -> graph id or None
  PyObject* graph_runs = nullptr;   // Compiled.graph_runs: graph id -> runs
  PyObject* sources = nullptr;      // Compiled._sources: id(fn) -> (weakref, source)
  PyObject* graphs = nullptr;       // GraphLogHandler.graphs: graph id -> GraphInfo
  PyObject* nothing = nullptr;      // the exit hook of a call not recorded
};
CompiledHook g_cc;
bool g_cc_open = false;  // a call entered by compiled_enter has not left yet
int64_t g_cc_start = 0;
PyObject* g_cc_step = nullptr;
PyObject* g_cc_src = nullptr;
Py_ssize_t g_cc_base = 0;
PyObject* g_cc_leave_fn = nullptr;

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;  // kept for the life of the process
}

struct CcNames {
  PyObject *depth, *sticky, *compiled_depth, *step_index, *aside, *enter, *source_for,
      *resolve, *step_back, *copies, *copy_bytes, *fn;
  CcNames()
      : depth(interned("depth")), sticky(interned("sticky")),
        compiled_depth(interned("compiled_depth")), step_index(interned("step_index")),
        aside(interned("_aside")), enter(interned("enter")),
        source_for(interned("_source_for")), resolve(interned("resolve")),
        step_back(interned("_step_back")), copies(interned("copies")),
        copy_bytes(interned("copy_bytes")), fn(interned("fn")) {}
};
CcNames* g_ccn = nullptr;

PyObject* frame_var_of(PyFrameObject* frame, PyObject* name);  // new reference or null

// The source of the callable the compile_wrapper frame (a caller of the hook) wraps.
PyObject* cc_source() {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed: the frame that calls the hook
  Py_XINCREF(frame);
  for (int i = 0; i < 5 && frame != nullptr; ++i) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    const bool found = PyUnicode_CompareWithASCIIString(code->co_name, "compile_wrapper") == 0;
    Py_DECREF(code);
    if (found) break;
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  if (frame == nullptr) Py_RETURN_NONE;
  PyObject* fn = frame_var_of(frame, g_ccn->fn);
  Py_DECREF(frame);
  if (fn == nullptr) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  PyObject* key = PyLong_FromVoidPtr(fn);
  PyObject* hit = key != nullptr ? PyDict_GetItemWithError(g_cc.sources, key) : nullptr;
  Py_XDECREF(key);
  if (hit != nullptr && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2) {
    PyObject* target = PyMethod_Check(fn) ? PyMethod_GET_SELF(fn) : fn;
    PyObject* ref = PyTuple_GET_ITEM(hit, 0);
    if (PyWeakref_Check(ref) && PyWeakref_GetObject(ref) == target) {
      Py_DECREF(fn);
      PyObject* src = PyTuple_GET_ITEM(hit, 1);
      Py_INCREF(src);
      return src;
    }
  }
  if (PyErr_Occurred()) PyErr_Clear();
  PyObject* src = PyObject_CallMethodOneArg(g_cc.state, g_ccn->source_for, fn);
  Py_DECREF(fn);
  if (src == nullptr) {
    swallow();
    Py_RETURN_NONE;
  }
  return src;
}

inline void cc_set_depth(PyObject* value) {
  if (PyObject_SetAttr(g_cc.state, g_ccn->depth, value) < 0) swallow();
  if (PyObject_SetAttr(g_cc.rec, g_ccn->compiled_depth, value) < 0) swallow();
}

PyObject* compiled_enter(PyObject*, PyObject*) {
  if (g_cc.state == nullptr || !tls_cfs_thread) {
    if (g_cc.nothing != nullptr) return Py_NewRef(g_cc.nothing);
    Py_RETURN_NONE;  // cannot happen: the hook is in torch's lists only while installed
  }
  PyObject* depth = PyObject_GetAttr(g_cc.state, g_ccn->depth);
  PyObject* sticky = PyObject_GetAttr(g_cc.state, g_ccn->sticky);
  const bool plain = depth != nullptr && sticky != nullptr && !g_cc_open &&
                     PyLong_Check(depth) && PyLong_AsLong(depth) == 0 &&
                     PyObject_IsTrue(sticky) == 0 &&
                     at::impl::PythonTorchFunctionTLS::stack_len() == 0 &&
                     c10::impl::TorchDispatchModeTLS::stack_len() == 0;
  Py_XDECREF(depth);
  Py_XDECREF(sticky);
  if (PyErr_Occurred()) swallow();
  if (!plain) return PyObject_CallMethodNoArgs(g_cc.state, g_ccn->enter);
  PyObject* one = PyLong_FromLong(1);
  cc_set_depth(one);
  Py_DECREF(one);
  suppress_region();
  g_cc_open = true;
  g_cc_start = now_ns();
  Py_XSETREF(g_cc_step, PyObject_GetAttr(g_cc.rec, g_ccn->step_index));
  if (g_cc_step == nullptr) swallow();
  Py_XSETREF(g_cc_src, cc_source());
  g_cc_base = PyDict_GET_SIZE(g_cc.graphs);
  Py_XSETREF(g_cfs_codes, PyList_New(0));
  if (g_cfs_codes == nullptr) swallow();
  return Py_NewRef(g_cc_leave_fn);
}

// The call's graph ids, runs and copies; then its tuple in Compiled._raw.
void cc_record(int64_t end, PyObject* codes) {
  const Py_ssize_t n = codes != nullptr ? PyList_GET_SIZE(codes) : 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyDict_Contains(g_cc.code_graphs, PyList_GET_ITEM(codes, i)) != 1) {
      PyObject* r = PyObject_CallMethodOneArg(g_cc.state, g_ccn->resolve, codes);
      if (r == nullptr) swallow(); else Py_DECREF(r);
      break;
    }
  }
  PyObject* ids = PyList_New(0);
  if (ids == nullptr) return swallow();
  long long copies = 0, nbytes = 0, unknown = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* gid = PyDict_GetItemWithError(g_cc.code_graphs, PyList_GET_ITEM(codes, i));
    if (gid == nullptr || gid == Py_None) continue;
    if (PyList_Append(ids, gid) < 0) break;
    PyObject* runs = PyDict_GetItemWithError(g_cc.graph_runs, gid);
    PyObject* more = PyLong_FromLongLong((runs != nullptr ? PyLong_AsLongLong(runs) : 0) + 1);
    if (more == nullptr || PyDict_SetItem(g_cc.graph_runs, gid, more) < 0) swallow();
    Py_XDECREF(more);
    PyObject* info = PyDict_GetItemWithError(g_cc.graphs, gid);
    if (info == nullptr) {
      ++unknown;
      continue;
    }
    PyObject* list = PyObject_GetAttr(info, g_ccn->copies);
    PyObject* size = PyObject_GetAttr(info, g_ccn->copy_bytes);
    if (list != nullptr && size != nullptr) {
      copies += PyObject_Size(list);
      nbytes += PyLong_AsLongLong(size);
    }
    Py_XDECREF(list);
    Py_XDECREF(size);
  }
  if (PyErr_Occurred()) swallow();
  PyObject* row = Py_BuildValue(
      "(LLOOOnLLL)", static_cast<long long>(g_cc_start), static_cast<long long>(end),
      g_cc_step != nullptr ? g_cc_step : Py_None, g_cc_src != nullptr ? g_cc_src : Py_None, ids,
      PyDict_GET_SIZE(g_cc.graphs) - g_cc_base, copies, nbytes, unknown);
  Py_DECREF(ids);
  if (row == nullptr || PyList_Append(g_cc.raw, row) < 0) swallow();
  Py_XDECREF(row);
}

PyObject* compiled_leave(PyObject*, PyObject*) {
  const int64_t end = now_ns();
  unsuppress_region();
  PyObject* codes = g_cfs_codes;  // owned from here
  g_cfs_codes = nullptr;
  const bool open = g_cc_open;
  g_cc_open = false;
  if (open && g_cc.state != nullptr) {  // else: tracing stopped inside the call
    PyObject* zero = PyLong_FromLong(0);
    cc_set_depth(zero);
    Py_DECREF(zero);
    PyObject* aside = PyObject_GetAttr(g_cc.state, g_ccn->aside);
    if (aside != nullptr && aside != Py_None) {  // dynamo compiled a frame: step back
      PyObject* r = PyObject_CallMethodNoArgs(g_cc.state, g_ccn->step_back);
      if (r == nullptr) swallow(); else Py_DECREF(r);
    }
    Py_XDECREF(aside);
    if (PyErr_Occurred()) swallow();
    cc_record(end, codes);
  }
  Py_XDECREF(codes);
  Py_CLEAR(g_cc_step);
  Py_CLEAR(g_cc_src);
  Py_RETURN_NONE;
}

// compiled_backward(fn, *args): a compiled graph's backward (CompiledFunctionBackward's user
// function), run as a compiled call's depth on the traced thread with the observer suppressed;
// with a mode on torch's stacks, or on another thread, Compiled._run_backward (Python) runs it.
PyObject* g_cc_run_backward = nullptr;  // interned "_run_backward"

PyObject* compiled_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "compiled_backward(fn, *args)");
    return nullptr;
  }
  if (g_cc.state == nullptr) return PyObject_Vectorcall(args[0], args + 1, nargs - 1, nullptr);
  if (!tls_cfs_thread || at::impl::PythonTorchFunctionTLS::stack_len() != 0 ||
      c10::impl::TorchDispatchModeTLS::stack_len() != 0) {
    PyObject* slow = PyObject_GetAttr(g_cc.state, g_cc_run_backward);
    if (slow == nullptr) return nullptr;
    PyObject* r = PyObject_Vectorcall(slow, args, nargs, nullptr);
    Py_DECREF(slow);
    return r;
  }
  PyObject* state = g_cc.state;  // held for the call: tracing may stop inside it
  Py_INCREF(state);
  PyObject* rec = g_cc.rec;
  Py_INCREF(rec);
  auto set_depth = [&](long delta) {
    PyObject* depth = PyObject_GetAttr(state, g_ccn->depth);
    long d = depth != nullptr ? PyLong_AsLong(depth) : 0;
    Py_XDECREF(depth);
    PyObject* value = PyLong_FromLong(std::max(0L, d + delta));
    if (value == nullptr || PyObject_SetAttr(state, g_ccn->depth, value) < 0 ||
        PyObject_SetAttr(rec, g_ccn->compiled_depth, value) < 0)
      swallow();
    Py_XDECREF(value);
    if (PyErr_Occurred()) swallow();
  };
  set_depth(1);
  suppress_region();
  PyObject* result = PyObject_Vectorcall(args[0], args + 1, nargs - 1, nullptr);
  PyObject *etype = nullptr, *evalue = nullptr, *etb = nullptr;
  if (result == nullptr) PyErr_Fetch(&etype, &evalue, &etb);
  unsuppress_region();
  set_depth(-1);
  if (result == nullptr) PyErr_Restore(etype, evalue, etb);
  Py_DECREF(rec);
  Py_DECREF(state);
  return result;
}

PyMethodDef g_cc_backward_def = {"compiled_backward", reinterpret_cast<PyCFunction>(
                                     reinterpret_cast<void (*)()>(&compiled_backward)),
                                 METH_FASTCALL, "a compiled graph's backward, observer suppressed"};

// BackwardCFunction._get_user_fn, in C (an instance method): torch's own, and for a compiled
// graph's backward (CompiledFunctionBackward) that user function bound to compiled_backward.
PyObject* g_uf_orig = nullptr;     // torch's BackwardCFunction._get_user_fn
PyObject* g_uf_partial = nullptr;  // functools.partial
PyObject* g_uf_run = nullptr;      // compiled_backward

PyObject* user_fn(PyObject*, PyObject* node) {
  if (g_uf_orig == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "copytrace's _get_user_fn is not installed");
    return nullptr;
  }
  PyObject* fn = PyObject_CallOneArg(g_uf_orig, node);
  if (fn == nullptr || g_uf_run == nullptr ||
      std::strcmp(Py_TYPE(node)->tp_name, "CompiledFunctionBackward") != 0)
    return fn;
  PyObject* bound = PyObject_CallFunctionObjArgs(g_uf_partial, g_uf_run, fn, nullptr);
  if (bound == nullptr) {
    swallow();
    return fn;
  }
  Py_DECREF(fn);
  return bound;
}

PyMethodDef g_user_fn_def = {"_get_user_fn", &user_fn, METH_O,
                             "copytrace's BackwardCFunction._get_user_fn (see observer.cpp)"};

// user_fn_install(orig, partial, run) -> the instance method to set on BackwardCFunction;
// user_fn_install(None, None, None) clears (torch's own must be put back first).
py::object user_fn_install(py::object orig, py::object partial, py::object run) {
  const bool on = !orig.is_none();
  set_slot(g_uf_orig, orig);
  set_slot(g_uf_partial, partial);
  set_slot(g_uf_run, run);
  if (!on) return py::none();
  PyObject* fn = PyCFunction_NewEx(&g_user_fn_def, nullptr, nullptr);
  if (fn == nullptr) throw py::error_already_set();
  PyObject* method = PyInstanceMethod_New(fn);
  Py_DECREF(fn);
  if (method == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(method);
}

PyMethodDef g_cc_enter_def = {"compiled_enter", &compiled_enter, METH_NOARGS,
                              "copytrace's enter hook of torch.compile contexts (C path)"};
PyMethodDef g_cc_leave_def = {"compiled_leave", &compiled_leave, METH_NOARGS,
                              "the exit hook of a call compiled_enter recorded"};

// cc_install(state, rec, raw, code_graphs, graph_runs, sources, graphs, nothing) on the traced
// thread; cc_install(None, ...) clears and returns whether a call compiled_enter recorded is
// still open (tracing stops inside it: its exit only unsuppresses).
bool cc_install(py::object state, py::object rec, py::object raw, py::object code_graphs,
                py::object graph_runs, py::object sources, py::object graphs, py::object nothing) {
  if (g_ccn == nullptr) g_ccn = new CcNames();
  if (g_cc_run_backward == nullptr) g_cc_run_backward = interned("_run_backward");
  if (g_cc_leave_fn == nullptr) {
    g_cc_leave_fn = PyCFunction_NewEx(&g_cc_leave_def, nullptr, nullptr);
    if (g_cc_leave_fn == nullptr) throw py::error_already_set();
  }
  const bool was_open = g_cc_open;
  if (state.is_none()) g_cc_open = false;
  set_slot(g_cc.state, state);
  set_slot(g_cc.rec, rec);
  set_slot(g_cc.raw, raw);
  set_slot(g_cc.code_graphs, code_graphs);
  set_slot(g_cc.graph_runs, graph_runs);
  set_slot(g_cc.sources, sources);
  set_slot(g_cc.graphs, graphs);
  set_slot(g_cc.nothing, nothing);
  return was_open;
}

PyMethodDef g_frame_var_def = {"frame_var", reinterpret_cast<PyCFunction>(
                                   reinterpret_cast<void (*)()>(&frame_var)),
                               METH_FASTCALL,
                               "frame_var(frame, name): a frame's variable without f_locals"};

void define(py::module_& m) {
  m.def("clear_sites", &clear_sites, "Drop the call-site caches (and the code objects they hold)");
  m.def("cfs_install", &cfs_install, "orig, Compiled, Compiled._wrapped (None, None, None clears)");
  m.def("cfs_begin", &cfs_begin, "the open compiled call's code list, or None");
  m.def("user_fn_install", &user_fn_install,
        "orig, functools.partial, compiled_backward -> BackwardCFunction._get_user_fn "
        "(None, None, None clears)");
  m.def("cc_install", &cc_install,
        "state, rec, raw, code_graphs, graph_runs, sources, graphs, nothing (None clears; "
        "returns whether a call was open)");
  for (PyMethodDef* def : {&g_facts_def, &g_copy_slots_def, &g_call_site_def, &g_record_def,
                           &g_frame_var_def, &g_cfs_def, &g_cc_enter_def,
                           &g_cc_backward_def}) {
    PyObject* fn = PyCFunction_NewEx(def, nullptr, m.ptr());
    if (fn == nullptr) throw py::error_already_set();
    m.add_object(def->ml_name, py::reinterpret_steal<py::object>(fn));
  }
}

}  // namespace copytrace_facts
