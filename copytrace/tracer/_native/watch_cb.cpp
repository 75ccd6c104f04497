// Level lean's write watch: in-place writes into watched tensors, without a mode.
//
// Two hazards need every torch call on a few tensors: writes through a `.data` alias of a
// tensor that requires grad (autograd cannot see them: `data-inplace`) and writes into an
// advanced-indexing result (a fresh gather: `lost-inplace-write` when the result then dies
// unused). A TorchFunctionMode would see them, but a mode joining torch's stack while such a
// tensor lives is visible to the program (torch._C._len_torch_function_stack()). Instead a
// thread-local RecordFunction callback, registered on the traced thread only while a tensor is
// watched, reads each aten op's inputs and its schema: an input whose version counter is a
// watched one is written (its argument's alias_info is_write: `Tensor(a!)`) or read. The
// outermost such op on a thread is handed to the Python hook (hook(hits), each hit a tuple
// (key, written, storage or None): storage, a written alias's StorageImpl address, never a
// Python storage object, see facts.cpp); the ops inside it are its own internals (zero_'s
// fill_).
//
// A tensor is named by its version counter's address (`key`): the counter is shared by the
// tensor and all its views, so a write through a view is a write into it, and a `.data` alias
// has its own counter, apart from its source's. Nothing is held on the tensor: the Python side
// keeps a VersionRef handle on the counter (versions.cpp) while the key is watched, so the
// address is not reused meanwhile. Nothing changes a program can read: no mode, no hook, no
// weak reference; the callback is removed when the last key is unwatched on the traced thread
// (elsewhere it stays, inert, until then or until stop).
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <thread>
#include <unordered_map>
#include <vector>

#include "observer.h"

namespace copytrace {
namespace {

static_assert(sizeof(c10::VariableVersion) == sizeof(void*),
              "VariableVersion is one intrusive pointer to its VersionCounter");

enum WatchKind : int { WATCH_ALIAS = 1, WATCH_INDEX = 2 };

std::unordered_map<const void*, int> g_watched;  // counter address -> kinds; GIL held
std::atomic<bool> g_any_watched{false};
PyObject* g_watch_hook = nullptr;  // hook(hits)
at::CallbackHandle g_watch_rf = 0;
std::thread::id g_watch_rf_thread;
// Written argument positions of each op, by RecordFunction::name() (the schema's own string).
std::unordered_map<const char*, std::vector<bool>> g_written_args;
thread_local int tls_watch_depth = 0;  // inside an op handed to the hook (or the hook itself)

// The address of t's version counter, null for none (an inference tensor, undefined).
inline const void* counter_key(const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  const c10::VariableVersion& counter = t.unsafeGetTensorImpl()->version_counter();
  return *reinterpret_cast<void* const*>(&counter);
}

// Cached for operators only (a name that is no schema's may be a string freed since).
const std::vector<bool>& written_args(const at::RecordFunction& fn) {
  static const std::vector<bool> none;
  auto found = g_written_args.find(fn.name());
  if (found != g_written_args.end()) return found->second;
  auto schema = fn.operator_schema();
  if (!schema) return none;
  std::vector<bool> written;
  for (const auto& arg : schema->arguments()) {
    const auto* info = arg.alias_info();
    written.push_back(info != nullptr && info->isWrite());
  }
  return g_written_args.emplace(fn.name(), std::move(written)).first->second;
}

struct Hit {
  const void* key;
  bool written;
  // a written alias's StorageImpl (the pending write is keyed by its address); the op's
  // inputs hold it while the hook runs
  const c10::StorageImpl* storage;
};

void note(std::vector<Hit>& hits, const at::Tensor& t, bool written) {
  const void* key = counter_key(t);
  if (key == nullptr) return;
  auto found = g_watched.find(key);
  if (found == g_watched.end()) return;
  for (auto& hit : hits) {
    if (hit.key == key) {
      hit.written = hit.written || written;
      return;
    }
  }
  const bool alias_write = written && (found->second & WATCH_ALIAS) != 0;
  const c10::StorageImpl* storage = nullptr;
  if (alias_write && t.has_storage()) storage = t.storage().unsafeGetStorageImpl();
  hits.push_back({key, written, storage});
}

void call_hook(std::vector<Hit>& hits) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(hits.size()));
  if (tuple == nullptr) return swallow();
  for (size_t i = 0; i < hits.size(); ++i) {
    PyObject* storage = hits[i].storage != nullptr
                            ? PyLong_FromVoidPtr(const_cast<c10::StorageImpl*>(hits[i].storage))
                            : Py_NewRef(Py_None);
    void* key = const_cast<void*>(hits[i].key);
    PyObject* item = storage == nullptr
                         ? nullptr
                         : Py_BuildValue("(NON)", PyLong_FromVoidPtr(key),
                                         hits[i].written ? Py_True : Py_False, storage);
    if (item == nullptr) {
      Py_DECREF(tuple);
      return swallow();
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), item);
  }
  PyObject* r = PyObject_CallOneArg(g_watch_hook, tuple);
  Py_DECREF(tuple);
  if (r == nullptr) return swallow();
  Py_DECREF(r);
}

struct Touched : at::ObserverContext {};

std::unique_ptr<at::ObserverContext> watch_start(const at::RecordFunction& fn) {
  if (tls_watch_depth > 0 || tls_suppress > 0 || !g_any_watched.load(std::memory_order_relaxed))
    return nullptr;
  auto inputs = fn.inputs();
  bool any_tensor = false;
  for (const auto& v : inputs) any_tensor = any_tensor || v.isTensor() || v.isList();
  if (!any_tensor) return nullptr;
  PyGILState_STATE gil = PyGILState_Ensure();
  std::unique_ptr<at::ObserverContext> ctx;
  try {
    std::vector<Hit> hits;
    if (!g_watched.empty() && g_watch_hook != nullptr) {
      const std::vector<bool>& written = written_args(fn);
      for (size_t i = 0; i < inputs.size(); ++i) {
        const bool w = i < written.size() && written[i];
        const auto& v = inputs[i];
        if (v.isTensor()) {
          note(hits, v.toTensor(), w);
        } else if (v.isList()) {
          for (const auto& item : v.toListRef())
            if (item.isTensor()) note(hits, item.toTensor(), w);
        }
      }
    }
    if (!hits.empty()) {
      ++tls_watch_depth;  // the op's own internals, and the hook's, are not the program's
      ctx = std::make_unique<Touched>();
      call_hook(hits);
    }
  } catch (const std::exception&) {
    swallow();
  }
  PyGILState_Release(gil);
  return ctx;
}

void watch_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx != nullptr && tls_watch_depth > 0) --tls_watch_depth;
}

// Register the callback (on the traced thread) while a key is watched; remove it there when
// none is. Called with the GIL held.
void settle_callback() {
  const bool here = g_watch_rf_thread == std::this_thread::get_id();
  // added under a swapped TLS (in a backward) and gone with it: add it again where needed
  if (g_watch_rf != 0 && here && !in_tls(g_watch_rf)) g_watch_rf = 0;
  if (g_watched.empty()) {
    if (g_watch_rf != 0 && here) {
      at::removeCallback(g_watch_rf);
      g_watch_rf = 0;
    }
  } else if (g_watch_rf == 0 && tls_owner) {
    g_watch_rf = at::addThreadLocalCallback(at::RecordFunctionCallback(&watch_start, &watch_end)
                                                .needsInputs(true)
                                                .needsOutputs(false)
                                                .scopes({at::RecordScope::FUNCTION}));
    g_watch_rf_thread = std::this_thread::get_id();
  }
  g_any_watched.store(!g_watched.empty());
}

}  // namespace

// watch_tensor(t, kind) -> key of t's version counter (an int), or None (no counter)
PyObject* py_watch_tensor(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "watch_tensor(tensor, kind)")) return nullptr;
  const long kind = PyLong_AsLong(argv[1]);
  if (kind == -1 && PyErr_Occurred()) return nullptr;
  if (!THPVariable_Check(argv[0])) Py_RETURN_NONE;
  const void* key = nullptr;
  try {
    key = counter_key(THPVariable_Unpack(argv[0]));
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
  if (key == nullptr) Py_RETURN_NONE;
  g_watched[key] |= static_cast<int>(kind);
  settle_callback();
  return PyLong_FromVoidPtr(const_cast<void*>(key));
}

// unwatch(key, kind): stop watching the key for `kind` (the last kind gone: the key)
PyObject* py_unwatch(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "unwatch(key, kind)")) return nullptr;
  const void* key = PyLong_AsVoidPtr(argv[0]);
  const long kind = PyLong_AsLong(argv[1]);
  if (PyErr_Occurred()) return nullptr;
  auto found = g_watched.find(key);
  if (found != g_watched.end()) {
    found->second &= ~static_cast<int>(kind);
    if (found->second == 0) g_watched.erase(found);
  }
  settle_callback();
  Py_RETURN_NONE;
}

// set_watch_hook(hook or None): None also unwatches every key (tracing stops)
PyObject* py_set_watch_hook(PyObject*, PyObject* hook) {
  set_slot(g_watch_hook, hook);
  if (hook == Py_None) g_watched.clear();
  settle_callback();
  Py_RETURN_NONE;
}

PyObject* py_watched(PyObject*, PyObject*) {
  return Py_BuildValue("(nO)", static_cast<Py_ssize_t>(g_watched.size()),
                       g_watch_rf != 0 ? Py_True : Py_False);
}

}  // namespace copytrace
