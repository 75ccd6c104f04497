// The os.exec audit hook in C (PEP 578, PySys_AddAuditHook).
//
// CPython calls every audit hook on every audit event for the rest of the interpreter's life
// (a hook cannot be removed): a Python hook is a Python call on each, where the Python fallback
// alone raises about 25 a copy (builtins.id, object.__getattr__, sys._getframe). This hook
// compares the event's name in C and calls Python (copytrace/launch/process.py _on_exec) only
// for "os.exec", raised by every os.exec* function just before the exec system call
// (os_execv_impl, os_execve_impl). An error in that call is counted, never raised: the
// program's exec goes ahead (a hook that fails would refuse it).
// Python only: no torch header.
#include "observer.h"

namespace copytrace {
namespace {

PyObject* g_on_exec = nullptr;  // the Python callable called on "os.exec" (owned)
bool g_added = false;           // the hook is in CPython's list (for the process's life)

int exec_audit(const char* event, PyObject*, void*) {
  if (event[0] != 'o' || std::strcmp(event, "os.exec") != 0) return 0;
  PyObject* on_exec = g_on_exec;
  if (on_exec == nullptr) return 0;
  Py_INCREF(on_exec);
  PyObject* result = PyObject_CallNoArgs(on_exec);
  Py_DECREF(on_exec);
  if (result == nullptr)
    swallow();
  else
    Py_DECREF(result);
  return 0;
}

}  // namespace

PyObject* py_exec_hook(PyObject*, PyObject* on_exec) {
  if (!g_added) {
    // Existing hooks see "sys.addaudithook" and may refuse: a RuntimeError they raise is
    // cleared by CPython and the hook not added (0 returned); another error is raised here.
    if (PySys_AddAuditHook(exec_audit, nullptr) < 0) return nullptr;
    g_added = true;
  }
  set_slot(g_on_exec, on_exec);
  Py_RETURN_NONE;
}

}  // namespace copytrace
