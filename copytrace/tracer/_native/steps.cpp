// Optimizer steps, seen from torch's own record scope instead of optimizer hooks.
//
// Optimizer.profile_hook_step (torch/optim/optimizer.py) wraps every optimizer's step() in
// torch.autograd.profiler.record_function("Optimizer.step#<Class>.step"), profiler or not: a
// USER_SCOPE RecordFunction, active only while some callback wants that scope. A thread-local
// callback on USER_SCOPE alone hands the begin and end of each such scope to Python (the
// optimizer phase, the step boundary), where torch's global optimizer step hook dicts would
// have shown a program copytrace's hooks. Registered on the thread that starts tracing, which
// alone can remove it (as kernels.cpp's depth callback).
//
// Idle (set_step_idle): an armed session that records nothing and has no window due only
// needs the steps counted, in C, calling no Python. A registered RecordFunction callback of
// any kind costs at every autograd node, not at the step: the engine restores the graph
// task's thread-local state around each node it runs (ThreadLocalStateGuard in
// torch/csrc/autograd/engine.cpp), and LocalCallbackManager::setTLS copies the thread's
// callbacks and rebuilds its per-scope caches from them and from the global ones
// (aten/src/ATen/record_function.cpp), allocating for each callback it finds. So while idle
// the callback is taken off, and the steps are counted at torch's profiler hook point
// instead: Optimizer._optimizer_step_code, an empty method profile_hook_step calls after each
// step(), runs copytrace/tracer/_stepcode.py's code while the session is armed, which calls
// optimizer_step_seen() below (set_step_code tells this file it is there). An optimizer
// stepping another counts once: only the call under the outermost profile_hook_step wrapper
// on the thread's stack counts. Without that code (set_step_code(None)) the idle callback
// stays and counts the outermost scopes that end.
//
// Leaving idle puts the callback back. A step that was open then (its RecordFunction began
// without the callback, so its end is not seen) ends at its optimizer_step_seen() instead;
// a step that begins with the callback on clears that.
#include <ATen/record_function.h>

#include <cstring>
#include <thread>

#include "observer.h"

namespace copytrace {
namespace {

PyObject* g_step_begin = nullptr;  // owned; changed only with the GIL held
PyObject* g_step_end = nullptr;
PyObject* g_wrapper_code = nullptr;  // owned: profile_hook_step's wrapper's code, or null
at::CallbackHandle g_step_rf = 0;
std::thread::id g_step_thread;
constexpr char kStepScope[] = "Optimizer.step#";
bool g_idle = false;          // count only; changed only with the GIL held, on any thread
long long g_idle_steps = 0;   // outermost steps ended while idle
int g_idle_depth = 0;         // step scopes open while idle (without the step code only)
bool g_end_pending = false;   // idle ended: a step may be open that its callback missed

void step_call(PyObject** slot) {
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* fn = *slot;
  if (fn != nullptr) {
    Py_INCREF(fn);
    PyObject* r = PyObject_CallNoArgs(fn);
    if (r == nullptr && !given_back()) {
      g_errors.fetch_add(1, std::memory_order_relaxed);
      PyErr_WriteUnraisable(fn);
    }
    Py_XDECREF(r);
    Py_DECREF(fn);
  }
  PyGILState_Release(gil);
}

inline bool is_step(const at::RecordFunction& fn) {
  const char* name = fn.name();
  return name != nullptr && std::strncmp(name, kStepScope, sizeof(kStepScope) - 1) == 0;
}

std::unique_ptr<at::ObserverContext> step_start(const at::RecordFunction& fn) {
  if (!is_step(fn)) return nullptr;
  if (g_idle) {
    ++g_idle_depth;
  } else {
    g_end_pending = false;  // a step begins with the callback on: none is open unseen
    step_call(&g_step_begin);
  }
  return nullptr;
}

void step_stop(const at::RecordFunction& fn, at::ObserverContext*) {
  if (!is_step(fn)) return;
  if (g_idle) {
    if (g_idle_depth > 0 && --g_idle_depth == 0) ++g_idle_steps;
  } else {
    step_call(&g_step_end);
  }
}

inline bool on_step_thread() { return g_step_thread == std::this_thread::get_id(); }

// The callback on (on the step thread only: a thread-local callback).
void add_step_rf() {
  if (g_step_rf != 0 && in_tls(g_step_rf)) return;
  g_step_rf = at::addThreadLocalCallback(at::RecordFunctionCallback(&step_start, &step_stop)
                                             .needsInputs(false)
                                             .needsOutputs(false)
                                             .scopes({at::RecordScope::USER_SCOPE}));
}

void remove_step_rf() {
  if (g_step_rf != 0 && in_tls(g_step_rf)) at::removeCallback(g_step_rf);
  g_step_rf = 0;
}

// Whether the calling Python frame runs under exactly one profile_hook_step wrapper: the
// outermost optimizer's step (an optimizer stepping another calls the method twice).
bool outermost_step() {
  int seen = 0;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr && seen < 2) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    if (reinterpret_cast<PyObject*>(code) == g_wrapper_code) ++seen;
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return seen == 1;
}

}  // namespace

// optimizer_step_seen(): from Optimizer._optimizer_step_code while copytrace's code stands
// there (copytrace/tracer/_stepcode.py), after each step(): count it while idle; end a step
// that was open when the idle ended. Raises nothing.
PyObject* py_optimizer_step_seen(PyObject*, PyObject*) {
  if (g_wrapper_code == nullptr || g_step_begin == nullptr || !on_step_thread())
    Py_RETURN_NONE;
  if (g_idle) {
    if (outermost_step()) ++g_idle_steps;
    Py_RETURN_NONE;
  }
  if (g_step_rf == 0) add_step_rf();  // the idle ended on another thread
  if (g_end_pending && outermost_step()) {
    g_end_pending = false;
    step_call(&g_step_end);
  }
  Py_RETURN_NONE;
}

// set_step_code(code): the step code stands at Optimizer._optimizer_step_code, and `code` is
// profile_hook_step's wrapper's code (idle then counts there, without the callback); None:
// it does not (idle counts with the callback).
PyObject* py_set_step_code(PyObject*, PyObject* code) {
  set_slot(g_wrapper_code, code);
  Py_RETURN_NONE;
}

// set_step_idle(on): count the steps in C only (on), or call the hooks again (off); either
// way return the steps counted since the last call, and start counting from 0.
PyObject* py_set_step_idle(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 1, "set_step_idle(on)")) return nullptr;
  const int on = PyObject_IsTrue(argv[0]);
  if (on < 0) return nullptr;
  const long long counted = g_idle_steps;
  g_idle_steps = 0;
  if (on && !g_idle) {
    if (g_wrapper_code != nullptr) {
      if (!on_step_thread()) return PyLong_FromLongLong(counted);  // stays with the callback
      remove_step_rf();
    }
    g_idle = true;
    g_end_pending = false;
  } else if (!on && g_idle) {
    g_idle = false;
    g_idle_depth = 0;  // without the step code: a step open now ends through the hooks
    if (g_wrapper_code != nullptr) {
      g_end_pending = true;
      if (on_step_thread()) add_step_rf();  // else at the next optimizer_step_seen()
    }
  }
  return PyLong_FromLongLong(counted);
}

// set_step_hooks(begin, end): call begin() and end() around each optimizer step on this
// thread; (None, None) removes the callback (on its own thread). Returns whether it is on.
PyObject* py_set_step_hooks(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "set_step_hooks(begin, end)")) return nullptr;
  const bool on = argv[0] != Py_None && argv[1] != Py_None;
  set_slot(g_step_begin, on ? argv[0] : Py_None);
  set_slot(g_step_end, on ? argv[1] : Py_None);
  if (!on) {
    g_idle = g_end_pending = false;
    g_idle_steps = g_idle_depth = 0;
    if (g_step_rf != 0 && on_step_thread()) remove_step_rf();
    g_step_rf = 0;
    Py_RETURN_FALSE;
  }
  if (g_step_rf != 0 && (!on_step_thread() || !in_tls(g_step_rf)))
    g_step_rf = 0;  // left on another thread, or gone with a swapped TLS
  g_step_thread = std::this_thread::get_id();
  add_step_rf();
  Py_RETURN_TRUE;
}

}  // namespace copytrace
