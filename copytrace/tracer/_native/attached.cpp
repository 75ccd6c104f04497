// An attached copy's end in C: what Recorder.api_tail (copytrace/tracer/_api_events.py) does
// for a fresh copy with a grad_fn made outside backward and module calls (`x.clone()` of a
// tensor that requires grad), when nothing calls for Python: the grad_fn tagged in NodeTags
// (_node_tags.py), the copy listed as an _Attached entry (watch/_retained.py) with torch's weak
// handle on its storage (a StorageRef, _storage_ref.py) and counted under its call site
// (watch/_accumulate.py, _note_site). The objects made are the Python classes' own (their
// __slots__ filled in place, as copy_slots fills an event), with the values the Python path
// gives them. Any case that would do more (a table due for its prune, a site new, restarted,
// due for its check or flagged, a node that is not a C++ one) is left to Python whole: the
// checks come before anything is changed.
// Python only: the torch facts come from versions.cpp and facts.cpp (node_facts,
// storage_impl_of).
#include "observer.h"

#include <structmember.h>

#include <cstring>

namespace copytrace {
namespace {

PyTypeObject* g_attached_type = nullptr;  // watch/_retained.py's _Attached (owned)
PyTypeObject* g_ref_type = nullptr;       // _storage_ref.py's StorageRef (owned)
PyObject* g_ref_free = nullptr;           // UntypedStorage._free_weak_ref
PyObject* g_ref_owners = nullptr;         // storage_owners (this module's)
constexpr Py_ssize_t kMaxAttached = 100000;  // watch/_watch.py's _MAX_ATTACHED

enum AttachedSlot : int { A_node, A_ev, A_seq, A_kind, A_storage, A_pending, A_COUNT };
const char* const kAttachedSlots[A_COUNT] = {"node", "ev", "seq", "kind", "storage", "pending"};
Py_ssize_t g_attached_offsets[A_COUNT];
enum RefSlot : int { R_cdata, R_free, R_owners, R_COUNT };
const char* const kRefSlots[R_COUNT] = {"cdata", "_free", "_owners"};
Py_ssize_t g_ref_offsets[R_COUNT];

struct Names {
  PyObject *node_tags, *tags, *limit, *attached, *attached_prune, *sites, *backward_seq, *count,
      *next_check, *flagged, *mark, *last, *file, *line, *module, *transfer, *none;
};
Names* g_names = nullptr;

PyObject* interned(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) Py_FatalError("copytrace observer: out of memory interning a name");
  return o;
}

// The offsets of `names` among type's __slots__; false (TypeError) where one is missing.
bool slot_offsets(PyTypeObject* type, const char* const* names, int n, Py_ssize_t* offsets) {
  if (type->tp_members == nullptr || type->tp_dictoffset != 0) {
    PyErr_Format(PyExc_TypeError, "set_attached: %s has no __slots__", type->tp_name);
    return false;
  }
  for (int i = 0; i < n; ++i) {
    offsets[i] = -1;
    for (PyMemberDef* m = type->tp_members; m->name != nullptr; ++m)
      if (m->type == T_OBJECT_EX && std::strcmp(m->name, names[i]) == 0) offsets[i] = m->offset;
    if (offsets[i] < 0) {
      PyErr_Format(PyExc_TypeError, "set_attached: %s has no slot %s", type->tp_name, names[i]);
      return false;
    }
  }
  return true;
}

inline void set_at(PyObject* obj, Py_ssize_t offset, PyObject* value) {  // steals value
  PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
  PyObject* old = *slot;
  *slot = value;
  Py_XDECREF(old);
}

// attribute `name` of obj as a long long; false where it is missing or no int (error cleared)
inline bool attr_int(PyObject* obj, PyObject* name, long long* out) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) return false;
  *out = PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
  const bool ok = PyLong_Check(v) && !PyErr_Occurred();
  Py_DECREF(v);
  return ok;
}

// Owned references read before anything is changed, released at the end.
struct Held {
  PyObject *tags_obj = nullptr, *tags = nullptr, *attached = nullptr, *sites = nullptr,
           *site = nullptr, *file = nullptr, *line = nullptr, *module = nullptr,
           *ref = nullptr, *leaf_version = nullptr;
  ~Held() {
    for (PyObject* o : {tags_obj, tags, attached, sites, site, file, line, module, ref,
                        leaf_version})
      Py_XDECREF(o);
  }
};

// The checks: 1 when the C path may finish the event (h filled, *count the site's count),
// 0 when Python must (no error set).
int attached_ready(PyObject* rec, PyObject* watch, PyObject* ev, PyObject* grad_fn, Held& h,
                   long long* seq, long long* count) {
  const Names& n = *g_names;
  PyObject* transfer = PyObject_GetAttr(ev, n.transfer);
  const bool moved = transfer == nullptr || !PyUnicode_Check(transfer) ||
                     (transfer != n.none && PyUnicode_Compare(transfer, n.none) != 0);
  Py_XDECREF(transfer);
  if (moved) return 0;  // a transfer: settle_unreal may apply (api_tail)
  h.file = PyObject_GetAttr(ev, n.file);
  h.line = h.file != nullptr ? PyObject_GetAttr(ev, n.line) : nullptr;
  h.module = h.line != nullptr ? PyObject_GetAttr(ev, n.module) : nullptr;
  if (h.module == nullptr || h.file == Py_None) return 0;  // no call site: no tag
  h.tags_obj = PyObject_GetAttr(rec, n.node_tags);
  h.tags = h.tags_obj != nullptr ? PyObject_GetAttr(h.tags_obj, n.tags) : nullptr;
  long long limit = 0;
  if (h.tags == nullptr || !PyDict_CheckExact(h.tags) || !attr_int(h.tags_obj, n.limit, &limit) ||
      PyDict_GET_SIZE(h.tags) + 1 >= limit)
    return 0;  // NodeTags due for its prune
  h.attached = PyObject_GetAttr(watch, n.attached);
  long long prune = 0;
  if (h.attached == nullptr || !PyList_CheckExact(h.attached) ||
      PyList_GET_SIZE(h.attached) >= kMaxAttached || !attr_int(watch, n.attached_prune, &prune) ||
      PyList_GET_SIZE(h.attached) + 1 >= prune)
    return 0;  // the list full or due for its prune
  h.sites = PyObject_GetAttr(watch, n.sites);
  if (h.sites == nullptr || !PyDict_CheckExact(h.sites)) return 0;
  PyObject* key = PyTuple_Pack(2, h.file, h.line);
  if (key == nullptr) return 0;
  h.site = PyDict_GetItemWithError(h.sites, key);  // borrowed
  Py_DECREF(key);
  if (h.site == nullptr) return 0;  // a new site: _note_site makes it
  Py_INCREF(h.site);
  long long mark = 0, backward = 0, next_check = 0;
  if (!attr_int(h.site, n.mark, &mark) || !attr_int(watch, n.backward_seq, &backward) ||
      mark != backward || !attr_int(h.site, n.count, count) ||
      !attr_int(h.site, n.next_check, &next_check) || *count < 1 || *count + 1 >= next_check)
    return 0;  // restarted by a backward, or due for its check
  PyObject* flagged = PyObject_GetAttr(h.site, n.flagged);
  const bool plain = flagged == Py_False;
  Py_XDECREF(flagged);
  if (!plain) return 0;  // a flagged site notes each copy's bytes
  if (!node_facts(grad_fn, seq, &h.leaf_version)) return 0;  // not a C++ node
  h.ref = py_grad_fn_ref(nullptr, grad_fn);
  if (h.ref == nullptr || h.ref == Py_None) return 0;
  return 1;
}

// A StorageRef on out's storage (torch's weak handle taken), or None where out has none.
PyObject* storage_ref_of(PyObject* out) {
  void* impl = storage_impl_of(out);
  if (impl == nullptr) Py_RETURN_NONE;
  PyObject* key = PyLong_FromVoidPtr(impl);
  if (key == nullptr) return nullptr;
  PyObject* ref = g_ref_type->tp_alloc(g_ref_type, 0);
  PyObject* held = ref != nullptr ? py_storage_hold(nullptr, key) : nullptr;
  Py_DECREF(key);
  if (held == nullptr) {
    Py_XDECREF(ref);
    return nullptr;
  }
  set_at(ref, g_ref_offsets[R_cdata], held);
  set_at(ref, g_ref_offsets[R_free], Py_NewRef(g_ref_free));
  set_at(ref, g_ref_offsets[R_owners], Py_NewRef(g_ref_owners));
  return ref;
}

}  // namespace

int attached_finish(PyObject* rec, PyObject* watch, PyObject* ev, PyObject* out,
                    PyObject* grad_fn, PyObject* kind) {
  if (g_attached_type == nullptr || rec == nullptr || watch == nullptr || !PyUnicode_Check(kind))
    return 0;
  Held h;
  long long seq = 0, count = 0;
  if (attached_ready(rec, watch, ev, grad_fn, h, &seq, &count) != 1) {
    PyErr_Clear();
    return 0;
  }
  const Names& n = *g_names;
  // NodeTags.put(grad_fn, (module, "file:line", leaf version)) (_api_events._tag_grad_fn)
  PyObject* seq_o = PyLong_FromLongLong(seq);
  PyObject* where = PyUnicode_FromFormat("%S:%S", h.file, h.line);
  PyObject* value = seq_o != nullptr && where != nullptr
                        ? Py_BuildValue("(O(OOO))", h.ref, h.module, where, h.leaf_version)
                        : nullptr;
  PyObject* tkey = value != nullptr ? PyTuple_Pack(2, seq_o, kind) : nullptr;
  bool ok = tkey != nullptr && PyDict_SetItem(h.tags, tkey, value) == 0;
  Py_XDECREF(where);
  Py_XDECREF(value);
  Py_XDECREF(tkey);
  // Watch.follow's attached entry (_Attached.of), listed, and _note_site's count
  PyObject* a = ok ? g_attached_type->tp_alloc(g_attached_type, 0) : nullptr;
  PyObject* storage = a != nullptr ? storage_ref_of(out) : nullptr;
  if (storage != nullptr) {
    set_at(a, g_attached_offsets[A_node], Py_NewRef(h.ref));
    set_at(a, g_attached_offsets[A_ev], Py_NewRef(ev));
    set_at(a, g_attached_offsets[A_seq], Py_NewRef(seq_o));
    set_at(a, g_attached_offsets[A_kind], Py_NewRef(kind));
    set_at(a, g_attached_offsets[A_pending], Py_NewRef(Py_None));
    set_at(a, g_attached_offsets[A_storage], storage);
    PyObject* next = PyLong_FromLongLong(count + 1);
    ok = PyList_Append(h.attached, a) == 0 && next != nullptr &&
         PyObject_SetAttr(h.site, n.last, a) == 0 && PyObject_SetAttr(h.site, n.count, next) == 0;
    Py_XDECREF(next);
  } else {
    ok = false;
  }
  Py_XDECREF(a);
  Py_XDECREF(seq_o);
  return ok ? 1 : -1;
}

// set_attached(attached_cls, storage_ref_cls, free_weak_ref, storage_owners): the classes the
// C path fills and the two callables a StorageRef holds; None clears (Python finishes every
// attached copy). TypeError where a class lacks one of its slots.
PyObject* py_set_attached(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "set_attached(attached_cls, storage_ref_cls, free_weak_ref, owners)"))
    return nullptr;
  if (g_names == nullptr) {
    g_names = new Names{interned("node_tags"), interned("_tags"), interned("_limit"),
                        interned("attached"), interned("_attached_prune"), interned("sites"),
                        interned("_backward_seq"), interned("count"), interned("next_check"),
                        interned("flagged"), interned("mark"), interned("last"),
                        interned("file"), interned("line"), interned("module"),
                        interned("transfer"), interned("none")};
  }
  PyObject* old_attached = reinterpret_cast<PyObject*>(g_attached_type);
  g_attached_type = nullptr;  // off until the new set-up is complete
  Py_XDECREF(old_attached);
  if (argv[0] == Py_None) {
    set_slot(g_ref_free, Py_None);
    set_slot(g_ref_owners, Py_None);
    Py_RETURN_NONE;
  }
  if (!PyType_Check(argv[0]) || !PyType_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "set_attached: two classes expected");
    return nullptr;
  }
  auto* attached = reinterpret_cast<PyTypeObject*>(argv[0]);
  auto* ref = reinterpret_cast<PyTypeObject*>(argv[1]);
  if (!slot_offsets(attached, kAttachedSlots, A_COUNT, g_attached_offsets) ||
      !slot_offsets(ref, kRefSlots, R_COUNT, g_ref_offsets))
    return nullptr;
  set_slot(g_ref_free, argv[2]);
  set_slot(g_ref_owners, argv[3]);
  PyObject* old_ref = reinterpret_cast<PyObject*>(g_ref_type);
  g_ref_type = reinterpret_cast<PyTypeObject*>(Py_NewRef(argv[1]));
  Py_XDECREF(old_ref);
  g_attached_type = reinterpret_cast<PyTypeObject*>(Py_NewRef(argv[0]));
  Py_RETURN_NONE;
}

}  // namespace copytrace
