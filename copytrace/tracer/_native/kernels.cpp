// copytrace's dispatcher-level copy observer: the kernels.
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
// dtype/layout/device arguments). Registering ours there would override torch's and spend torch's
// once-per-process "Overriding a previously registered kernel" warning (TORCH_WARN_ONCE in
// OperatorEntry::registerKernel), which a program's own later torch.library override then
// never shows. So _to_copy's kernel goes one level down instead, on each backend key (CPU,
// CUDA, SparseCPU, QuantizedCPU, ...) where torch registers nothing of its own (those run the
// CompositeExplicitAutograd kernel, which ours calls): torch's BackendSelect kernel stays and
// no registration overrides anything. Meta is left out (fake and meta traffic is no copy), and
// so are keys with their own kernel (NestedTensorCPU, ...): their _to_copy is not observed.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/_to_copy_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/copy_ops.h>
#include <ATen/ops/detach_ops.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Export.h>
#include <torch/csrc/autograd/function.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// An aten argument (IValue) as the Python object torch makes of it: torch::jit::toPyObject,
// declared here rather than through torch/csrc/jit/python/pybind_utils.h, whose include tree
// (the whole TorchScript IR) cost most of the observer's build time. The function itself is
// libtorch_python's, so the objects are exactly torch's.
namespace torch::jit {
TORCH_PYTHON_API pybind11::object toPyObject(c10::IValue ivalue);
}  // namespace torch::jit

#define COPYTRACE_TORCH_TLS
#include "observer.h"

namespace copytrace {

std::atomic<bool> g_on{false};
std::atomic<int64_t> g_internal{0};
std::atomic<int64_t> g_errors{0};
std::vector<PyObject*> g_py_names;
__thread bool tls_owner = false;
__thread int tls_suppress = 0;
__thread int tls_depth = 0;
__thread bool tls_folding = false;
__thread TlsStack<int16_t> tls_fold = {nullptr, 0, 0};

namespace {

// A new reference, or null with a Python error set.
PyObject* ivalue_to_py(const c10::IValue& value) {
  try {
    return torch::jit::toPyObject(value).release().ptr();
  } catch (pybind11::error_already_set& err) {
    err.restore();
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
  return nullptr;
}

constexpr int kAlias = 1;  // detach, alias: autograd bookkeeping unless folded into an API call

struct OpInfo {
  int index = 0;
  int kind = 0;
  bool to_copy = false;  // replaces the generated BackendSelect kernel of aten::_to_copy
};

std::unordered_map<const c10::FunctionSchema*, OpInfo> g_ops;
std::unique_ptr<torch::Library> g_lib;
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
// The value: whether copytrace has a kernel for the op (a copy op, see OpenCopy below).
std::unordered_map<const char*, bool> g_counted;
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
// An autograd node's apply (BACKWARD_FUNCTION scope) starts afresh: the ops a node runs are
// what a dispatch mode sees in backward, whatever op is in progress around the engine.
thread_local std::vector<int> tls_saved_depth;

// Under torch.func.vmap one user call reaches the dispatcher several times as the same op:
// the functorch front layer's call, the interpreter's re-call, the batch rule's call on the
// physical tensor and the back layer's re-call (aten/src/ATen/functorch/DynamicLayer.cpp).
// A dispatch mode sees one of them, on the physical tensor. So an op started while a
// functorch layer is active counts once: its re-calls (the same op, innermost) do not.
thread_local std::vector<const char*> tls_functorch_ops;

// A Python __torch_dispatch__ (a program's TorchDispatchMode, FlopCounterMode, a wrapper tensor
// subclass) takes an op at the Python key, above BackendSelect, and usually calls the same op
// again (`func(*args)`): a second RecordFunction of the same name starts while the first has
// not reached any of copytrace's kernels. That re-call is the op itself, not an op inside the
// first one's kernel: it is not counted (copytrace's Python dispatch mode, below the program's,
// sees it so too). A same-named op started after the first reached copytrace's kernel is that
// kernel's own internals (a device copy_ copying through a temporary) and counts as usual.
// Entries are copy ops in progress (the ops copytrace has kernels for); nullptr marks a
// backward node's start, which begins afresh as tls_depth does.
struct OpenCopy {
  const char* name;
  int depth;     // tls_depth once counted
  bool entered;  // reached copytrace's kernel
};
thread_local std::vector<OpenCopy> tls_open_copies;

struct Mark : at::ObserverContext {
  bool counted = false;    // tls_depth was incremented
  bool functorch = false;  // pushed on tls_functorch_ops
  bool open_copy = false;  // pushed on tls_open_copies
};

inline bool functorch_active() {
  return c10::impl::tls_is_dispatch_key_included(
      c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

// The op a Python dispatch handler calls again: the innermost counted op, of the same name,
// and not yet in copytrace's kernel.
inline bool python_recall(const char* name) {
  if (tls_open_copies.empty()) return false;
  const OpenCopy& top = tls_open_copies.back();
  return top.name == name && top.depth == tls_depth && !top.entered;
}

// Called by every kernel of copytrace's: the innermost open copy op of this name reached it.
inline void mark_entered(const char* name) {
  if (tls_open_copies.empty()) return;
  OpenCopy& top = tls_open_copies.back();
  if (top.name == name && top.depth == tls_depth) top.entered = true;
}

std::unique_ptr<at::ObserverContext> rf_start(const at::RecordFunction& fn) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    tls_saved_depth.push_back(tls_depth);
    tls_depth = 0;
    tls_open_copies.push_back({nullptr, 0, false});
    return nullptr;
  }
  auto found = g_counted.find(fn.name());
  if (found == g_counted.end()) return nullptr;
  if (!tls_functorch_ops.empty() && tls_functorch_ops.back() == fn.name())
    return std::make_unique<Mark>();  // a functorch re-call: not counted
  const bool copy_op = found->second;
  if (copy_op && python_recall(fn.name())) return std::make_unique<Mark>();
  ++tls_depth;
  const bool functorch = functorch_active();
  if (!functorch && !copy_op) return nullptr;  // counted; rf_end decrements by name
  auto mark = std::make_unique<Mark>();
  mark->counted = true;
  if (functorch) {
    tls_functorch_ops.push_back(fn.name());
    mark->functorch = true;
  }
  if (copy_op) {
    tls_open_copies.push_back({fn.name(), tls_depth, false});
    mark->open_copy = true;
  }
  return mark;
}

void rf_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    if (!tls_saved_depth.empty()) {
      tls_depth = tls_saved_depth.back();
      tls_saved_depth.pop_back();
    }
    if (!tls_open_copies.empty()) tls_open_copies.pop_back();
    return;
  }
  if (ctx != nullptr) {
    auto* mark = static_cast<Mark*>(ctx);
    if (!mark->counted) return;  // a re-call
    if (mark->functorch && !tls_functorch_ops.empty()) tls_functorch_ops.pop_back();
    if (mark->open_copy && !tls_open_copies.empty()) tls_open_copies.pop_back();
  }
  if (tls_depth > 0 && g_counted.count(fn.name()) != 0) --tls_depth;
}

void counted_names() {
  if (!g_counted.empty()) return;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    auto handle = dispatcher.findOp(name);
    if (handle && handle->hasSchema() &&
        !handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
      g_counted.emplace(handle->schema().name().c_str(), false);
  }
  for (const auto& entry : g_ops) {
    auto counted = g_counted.find(entry.first->name().c_str());
    if (counted != g_counted.end()) counted->second = true;
  }
}

const c10::DispatchKeySet kAfterBS(c10::DispatchKeySet::FULL_AFTER,
                                   c10::DispatchKey::BackendSelect);

// aten::_to_copy(Tensor self, *, ScalarType? dtype, Layout? layout, Device? device,
// bool? pin_memory, bool non_blocking, MemoryFormat? memory_format) on a backend key: the
// CompositeExplicitAutograd kernel torch's own dispatch table holds there.
void to_copy_below(torch::jit::Stack* stack) {
  auto& s = *stack;
  const size_t base = s.size() - 7;
  at::Tensor out = at::compositeexplicitautograd::_to_copy(
      s[base].toTensor(), s[base + 1].toOptional<at::ScalarType>(),
      s[base + 2].toOptional<at::Layout>(), s[base + 3].toOptional<at::Device>(),
      s[base + 4].toOptional<bool>(), s[base + 5].toBool(),
      s[base + 6].toOptional<at::MemoryFormat>());
  torch::jit::drop(s, 7);
  torch::jit::push(s, std::move(out));
}

// The op's own work: below BackendSelect (every op but _to_copy) or _to_copy's backend kernel.
inline void forward(const c10::OperatorHandle& op, bool to_copy, c10::DispatchKeySet next,
                    torch::jit::Stack* stack) {
  if (to_copy) {
    to_copy_below(stack);
  } else {
    op.redispatchBoxed(next, stack);
  }
}

// The runtime keys _to_copy's kernel goes on: every backend key of the Dense, Quantized,
// Sparse and SparseCsr functionalities but Meta's, where torch has no kernel of its own.
std::vector<c10::DispatchKey> to_copy_keys(const c10::OperatorHandle& handle) {
  const c10::DispatchKeySet functionalities{c10::DispatchKey::Dense, c10::DispatchKey::Quantized,
                                            c10::DispatchKey::Sparse,
                                            c10::DispatchKey::SparseCsr};
  std::vector<c10::DispatchKey> keys;
  for (c10::DispatchKey k : c10::DispatchKeySet(c10::DispatchKeySet::FULL)) {
    if (!functionalities.has(c10::toFunctionalityKey(k))) continue;
    if (c10::toBackendComponent(k) == c10::BackendComponent::MetaBit) continue;
    if (!handle.hasKernelForDispatchKey(k)) keys.push_back(k);
  }
  return keys;
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

// The implicit copy to the callback: (name, kind, args, kwargs, result, t0, t1).
void call_back(const OpInfo& info, const c10::FunctionSchema& schema,
               const std::vector<c10::IValue>& args, const c10::IValue& out, int64_t t0,
               int64_t t1) {
  PyGILState_STATE gil = PyGILState_Ensure();
  if (g_callback == nullptr) {
    PyGILState_Release(gil);
    return;
  }
  NoTorchFunction no_tf;
  ++tls_suppress;
  const auto& arguments = schema.arguments();
  PyObject* pos = PyList_New(0);
  PyObject* kw = PyDict_New();
  bool ok = pos != nullptr && kw != nullptr;
  for (size_t i = 0; ok && i < args.size() && i < arguments.size(); ++i) {
    PyObject* value = ivalue_to_py(args[i]);
    if (value == nullptr) {
      ok = false;
    } else if (arguments[i].kwarg_only()) {
      ok = PyDict_SetItemString(kw, arguments[i].name().c_str(), value) == 0;
    } else {
      ok = PyList_Append(pos, value) == 0;
    }
    Py_XDECREF(value);
  }
  PyObject* result = !ok ? nullptr : out.isNone() ? Py_NewRef(Py_None) : ivalue_to_py(out);
  PyObject* tuple = result != nullptr ? PyList_AsTuple(pos) : nullptr;
  PyObject* r = tuple == nullptr
                    ? nullptr
                    : PyObject_CallFunction(g_callback, "OiOOOLL", g_py_names[info.index],
                                            info.kind, tuple, kw, result,
                                            static_cast<long long>(t0),
                                            static_cast<long long>(t1));
  if (r == nullptr && !given_back()) {
    g_errors.fetch_add(1, std::memory_order_relaxed);
    PyErr_WriteUnraisable(g_callback);  // as pybind11's discard_as_unraisable did
  }
  Py_XDECREF(r);
  Py_XDECREF(tuple);
  Py_XDECREF(result);
  Py_XDECREF(pos);
  Py_XDECREF(kw);
  --tls_suppress;
  PyGILState_Release(gil);
}

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  mark_entered(schema.name().c_str());
  auto found = g_ops.find(&schema);
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  c10::DispatchKeySet next = ks & kAfterBS;
  if (found == g_ops.end()) {  // cannot happen: only registered ops come here
    op.redispatchBoxed(next, stack);
    return;
  }
  const OpInfo& info = found->second;
  const bool to_copy = info.to_copy;
  if (!g_on.load(std::memory_order_relaxed) || tls_suppress > 0 ||
      !(tls_owner || torch::autograd::get_current_node() != nullptr)) {
    forward(op, to_copy, next, stack);
    return;
  }
  if (tls_depth > 1) {  // inside another op's kernel: not an op a dispatch mode would see
    forward(op, to_copy, next, stack);
    return;
  }
  if (tls_folding) {
    push(tls_fold, static_cast<int16_t>(info.index));
    forward(op, to_copy, next, stack);
    return;
  }
  if (info.kind == kAlias) {
    g_internal.fetch_add(1, std::memory_order_relaxed);
    forward(op, to_copy, next, stack);
    return;
  }
  if (on_meta(*stack, base, nargs)) {
    forward(op, to_copy, next, stack);
    return;
  }
  // The arguments are consumed by the call: keep them (reference counts only, no data).
  std::vector<c10::IValue> args(stack->begin() + base, stack->end());
  const int64_t t0 = now_ns();
  forward(op, to_copy, next, stack);
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
const char* g_detach_name = nullptr;  // RecordFunction names (the schemas' own strings)
const char* g_copy_name = nullptr;

// 0: only re-dispatch; 1: fold (index appended); 2: record (alias: counted; copy: boxed path)
inline int decide(int index) {
  if (index < 0 || !g_on.load(std::memory_order_relaxed) || tls_suppress > 0 ||
      !(tls_owner || torch::autograd::get_current_node() != nullptr) || tls_depth > 1)
    return 0;
  if (tls_folding) {
    push(tls_fold, static_cast<int16_t>(index));
    return 1;
  }
  return 2;
}

at::Tensor detach_kernel(c10::DispatchKeySet ks, const at::Tensor& self) {
  mark_entered(g_detach_name);
  if (decide(g_detach_index) == 2) g_internal.fetch_add(1, std::memory_order_relaxed);
  return at::_ops::detach::redispatch(ks & kAfterBS, self);
}

at::Tensor& copy__kernel(c10::DispatchKeySet ks, at::Tensor& self, const at::Tensor& src,
                         bool non_blocking) {
  mark_entered(g_copy_name);
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

struct OpSpec {
  std::string name, overload, display;
  int kind;
};

// install's list of (qualified name, overload, kind, display name); false with an error set.
bool parse_ops(PyObject* ops, std::vector<OpSpec>& out) {
  PyObject* seq = PySequence_Fast(ops, "install: a list of (name, overload, kind, display)");
  if (seq == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char *name, *overload, *display;
    int kind;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ssis", &name, &overload, &kind,
                          &display)) {
      Py_DECREF(seq);
      return false;
    }
    out.push_back({name, overload, display, kind});
  }
  Py_DECREF(seq);
  return true;
}

int install(const std::vector<OpSpec>& ops) {
  auto& dispatcher = c10::Dispatcher::singleton();
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                              std::optional<c10::DispatchKey>(), __FILE__,
                                              __LINE__);
  for (const auto& [name, overload, display, kind] : ops) {
    auto handle = dispatcher.findSchema(c10::OperatorName(name, overload));
    if (!handle) continue;
    const c10::FunctionSchema* schema = &handle->schema();
    if (g_ops.count(schema) == 0) {
      OpInfo info;
      info.index = static_cast<int>(g_py_names.size());
      info.kind = kind;
      info.to_copy = name == "aten::_to_copy" && overload.empty();
      PyObject* interned = PyUnicode_InternFromString(display.c_str());
      if (interned == nullptr) throw std::runtime_error("install: out of memory");
      g_py_names.push_back(interned);
      g_ops.emplace(schema, info);
    }
    std::string short_name = name.substr(name.find("::") + 2);
    if (!overload.empty()) short_name += "." + overload;
    const int index = g_ops[schema].index;
    if (name == "aten::detach" && overload.empty()) {
      g_detach_index = index;
      g_detach_name = schema->name().c_str();
      lib->impl("detach", torch::dispatch(c10::DispatchKey::BackendSelect,
                                          TORCH_FN(detach_kernel)));
      continue;
    }
    if (name == "aten::copy_" && overload.empty()) {
      g_copy_index = index;
      g_copy_name = schema->name().c_str();
      lib->impl("copy_", torch::dispatch(c10::DispatchKey::BackendSelect,
                                         TORCH_FN(copy__kernel)));
      continue;
    }
    if (g_ops[schema].to_copy) {
      for (c10::DispatchKey k : to_copy_keys(*handle))
        lib->impl(short_name.c_str(),
                  torch::dispatch(k, torch::CppFunction::makeFromBoxedFunction<&kernel>()));
      continue;
    }
    if (handle->hasKernelForDispatchKey(c10::DispatchKey::BackendSelect))
      continue;  // never override one of torch's kernels (none but _to_copy's today)
    lib->impl(short_name.c_str(),
              torch::dispatch(c10::DispatchKey::BackendSelect,
                              torch::CppFunction::makeFromBoxedFunction<&kernel>()));
  }
  g_lib = std::move(lib);
  counted_names();
  if (g_rf != 0 && (g_rf_thread != std::this_thread::get_id() || !in_tls(g_rf)))
    g_rf = 0;  // left on another thread, or gone with a swapped TLS
  if (g_rf == 0) {
    g_rf = at::addThreadLocalCallback(at::RecordFunctionCallback(&rf_start, &rf_end)
                                          .needsInputs(false)
                                          .needsOutputs(false)
                                          .scopes({at::RecordScope::FUNCTION,
                                                   at::RecordScope::BACKWARD_FUNCTION}));
    g_rf_thread = std::this_thread::get_id();
  }
  return static_cast<int>(g_ops.size());
}

PyObject* py_bool(bool v) { return Py_NewRef(v ? Py_True : Py_False); }

}  // namespace

bool in_tls(uint64_t handle) {
  static_assert(std::is_same_v<at::CallbackHandle, uint64_t>, "CallbackHandle is uint64_t");
  if (handle == 0) return false;
  for (const auto& entry : at::get_record_function_tls_().sorted_tls_callbacks_)
    if (entry.handle_ == handle) return true;
  return false;
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

// install(ops, callback) -> registered op count (see observer.pyi)
PyObject* py_install(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "install(ops, callback)")) return nullptr;
  if (!g_lib) {
    std::vector<OpSpec> ops;
    if (!parse_ops(argv[0], ops)) return nullptr;
    try {
      install(ops);
    } catch (const std::exception& err) {
      PyErr_SetString(PyExc_RuntimeError, err.what());
      return nullptr;
    }
    set_slot(g_callback, argv[1]);
  }
  return PyLong_FromSize_t(g_ops.size());
}

PyObject* py_uninstall(PyObject*, PyObject*) {
  g_on.store(false);
  if (g_rf != 0 && g_rf_thread == std::this_thread::get_id()) {
    if (in_tls(g_rf)) at::removeCallback(g_rf);
    g_rf = 0;
  }
  g_lib.reset();  // deregisters: every key's table entry is torch's own again
  Py_CLEAR(g_callback);
  Py_RETURN_NONE;
}

PyObject* py_set_enabled(PyObject*, PyObject* on) {
  const int v = PyObject_IsTrue(on);
  if (v < 0) return nullptr;
  g_on.store(v == 1);
  Py_RETURN_NONE;
}

PyObject* py_enabled(PyObject*, PyObject*) { return py_bool(g_on.load()); }

PyObject* py_set_owner(PyObject*, PyObject* owner) {
  const int v = PyObject_IsTrue(owner);
  if (v < 0) return nullptr;
  tls_owner = v == 1;
  Py_RETURN_NONE;
}

PyObject* py_suppress(PyObject*, PyObject*) {
  suppress_region();
  Py_RETURN_NONE;
}

PyObject* py_unsuppress(PyObject*, PyObject*) {
  unsuppress_region();
  Py_RETURN_NONE;
}

PyObject* py_suppressed(PyObject*, PyObject*) { return PyLong_FromLong(tls_suppress); }

PyObject* py_begin_fold(PyObject*, PyObject*) {
  tls_fold.size = 0;
  tls_folding = true;
  Py_RETURN_NONE;
}

PyObject* py_end_fold(PyObject*, PyObject*) {
  tls_folding = false;
  return fold_names();
}

PyObject* py_internal_detaches(PyObject*, PyObject*) {
  return PyLong_FromLongLong(g_internal.exchange(0));
}

PyObject* py_errors(PyObject*, PyObject*) { return PyLong_FromLongLong(g_errors.exchange(0)); }

PyObject* py_depth(PyObject*, PyObject*) { return PyLong_FromLong(tls_depth); }

}  // namespace copytrace
