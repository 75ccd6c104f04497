// The units that read torch's C++ types (Tensor, the dispatcher, autograd nodes), compiled as
// one translation unit: each parse of Tensor's headers costs about as much CPU as all the code
// here (about 17 s of the 2-core machine's CPU per unit, measured), so the units compiled apart
// made the cold build twice as long as the one file they came from. Each included unit still
// compiles alone (its own includes, then observer.h).
#include "kernels.cpp"
#include "versions.cpp"
#include "facts.cpp"
#include "record.cpp"
#include "watch_cb.cpp"
#include "steps.cpp"
