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
// needs the steps counted. The callbacks then count the outermost scopes that end, in C,
// and call no Python at all; the session reads the count when it wakes (a signal, an
// explicit step, the end).
#include <ATen/record_function.h>

#include <cstring>
#include <thread>

#include "observer.h"

namespace copytrace {
namespace {

PyObject* g_step_begin = nullptr;  // owned; changed only with the GIL held
PyObject* g_step_end = nullptr;
at::CallbackHandle g_step_rf = 0;
std::thread::id g_step_thread;
constexpr char kStepScope[] = "Optimizer.step#";
bool g_idle = false;          // count only; changed only with the GIL held, on any thread
long long g_idle_steps = 0;   // outermost step scopes ended while idle
int g_idle_depth = 0;         // step scopes open while idle (an optimizer stepping another)

void step_call(PyObject** slot) {
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* fn = *slot;
  if (fn != nullptr) {
    Py_INCREF(fn);
    PyObject* r = PyObject_CallNoArgs(fn);
    if (r == nullptr) {
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

}  // namespace

// set_step_idle(on): count the steps in C only (on), or call the hooks again (off); either
// way return the steps counted since the last call, and start counting from 0.
PyObject* py_set_step_idle(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 1, "set_step_idle(on)")) return nullptr;
  const int on = PyObject_IsTrue(argv[0]);
  if (on < 0) return nullptr;
  const long long counted = g_idle_steps;
  g_idle_steps = 0;
  if (!on) g_idle_depth = 0;  // a step open when the idle ends ends through the hooks
  g_idle = on != 0;
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
    g_idle = false;
    g_idle_steps = g_idle_depth = 0;
    if (g_step_rf != 0 && g_step_thread == std::this_thread::get_id()) {
      if (in_tls(g_step_rf)) at::removeCallback(g_step_rf);
      g_step_rf = 0;
    }
    Py_RETURN_FALSE;
  }
  if (g_step_rf != 0 && (g_step_thread != std::this_thread::get_id() || !in_tls(g_step_rf)))
    g_step_rf = 0;  // left on another thread, or gone with a swapped TLS
  if (g_step_rf == 0) {
    g_step_rf = at::addThreadLocalCallback(at::RecordFunctionCallback(&step_start, &step_stop)
                                               .needsInputs(false)
                                               .needsOutputs(false)
                                               .scopes({at::RecordScope::USER_SCOPE}));
    g_step_thread = std::this_thread::get_id();
  }
  Py_RETURN_TRUE;
}

}  // namespace copytrace
