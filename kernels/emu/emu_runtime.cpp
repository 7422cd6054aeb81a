// emu_runtime.cpp — the scheduler behind cuda_emu.h.
//
// A launch runs its blocks on `worker_count()` OS threads (the calling thread plus helpers
// spawned for the launch); each OS thread runs one block at a time. The CUDA threads of a
// block are fibers on that OS thread, scheduled round-robin: a fiber runs until it finishes
// or waits (barrier, warp exchange, spin-wait), then the next one runs. A switch saves the
// callee-saved registers and the stack pointer (x86-64, AArch64: a few instructions, no
// system call; ucontext elsewhere), which is what makes barrier-heavy kernels affordable.
// Fiber stacks are cached between launches, so a launch costs a few microseconds plus
// the kernel's own work.
//
// A cooperative launch gives every block its own OS thread at once, so that blocks that
// wait for each other through global memory (the collectives) all make progress.
#include "cuda_emu.h"
#include "emu_checks.h"

#include <signal.h>

#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__) && !defined(__aarch64__)
#include <ucontext.h>
#define MESA_EMU_UCONTEXT 1
#endif

#include <dlfcn.h>

#include <chrono>
#include <bitset>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>


// ---------------------------------------------------------------------------------------
// Fiber context switch: `mesa_emu_switch(&save_sp, next_sp)` pushes the callee-saved
// registers on the current stack, stores the stack pointer in *save_sp, loads next_sp and
// pops the next fiber's registers, returning into it. A fresh stack is prepared so that the
// first switch "returns" into fiber_start. On x86-64 the floating-point control state
// (MXCSR, x87 control word) is not switched: no kernel changes it, and run_block sets the
// default (round to nearest, no flush to zero) for the whole block and restores the caller's
// after it (FpEnvironment), so the switch does not reload it (no speed change was measurable).
#if defined(__x86_64__)
extern "C" void mesa_emu_switch(void** save_sp, void* next_sp);
asm(R"(
.text
.p2align 4
.globl mesa_emu_switch
.hidden mesa_emu_switch
.type mesa_emu_switch,@function
mesa_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size mesa_emu_switch,.-mesa_emu_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#elif defined(__aarch64__)
extern "C" void mesa_emu_switch(void** save_sp, void* next_sp);
asm(R"(
.text
.p2align 4
.globl mesa_emu_switch
.hidden mesa_emu_switch
.type mesa_emu_switch,%function
mesa_emu_switch:
  sub sp, sp, #0xb0
  stp x19, x20, [sp, #0x00]
  stp x21, x22, [sp, #0x10]
  stp x23, x24, [sp, #0x20]
  stp x25, x26, [sp, #0x30]
  stp x27, x28, [sp, #0x40]
  stp x29, x30, [sp, #0x50]
  stp d8, d9, [sp, #0x60]
  stp d10, d11, [sp, #0x70]
  stp d12, d13, [sp, #0x80]
  stp d14, d15, [sp, #0x90]
  mrs x9, fpcr
  str x9, [sp, #0xa0]
  mov x9, sp
  str x9, [x0]
  mov sp, x1
  ldr x9, [sp, #0xa0]
  msr fpcr, x9
  ldp x19, x20, [sp, #0x00]
  ldp x21, x22, [sp, #0x10]
  ldp x23, x24, [sp, #0x20]
  ldp x25, x26, [sp, #0x30]
  ldp x27, x28, [sp, #0x40]
  ldp x29, x30, [sp, #0x50]
  ldp d8, d9, [sp, #0x60]
  ldp d10, d11, [sp, #0x70]
  ldp d12, d13, [sp, #0x80]
  ldp d14, d15, [sp, #0x90]
  add sp, sp, #0xb0
  ret
.size mesa_emu_switch,.-mesa_emu_switch
.section .note.GNU-stack,"",%progbits
.text
)");
#endif

// AddressSanitizer build (MESA_EMU_SANITIZE=address): every switch between the scheduler's
// stack and a fiber's is announced, so that ASan's view of "the current stack" follows.
#ifdef MESA_EMU_ASAN
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, size_t* size_old);
extern "C" void __asan_unpoison_memory_region(void const volatile* addr, size_t size);
#define MESA_ASAN_START(save, bottom, size) __sanitizer_start_switch_fiber((save), (bottom), (size))
#define MESA_ASAN_FINISH(save, bottom_old, size_old) __sanitizer_finish_switch_fiber((save), (bottom_old), (size_old))
#else
#define MESA_ASAN_START(save, bottom, size) ((void)0)
#define MESA_ASAN_FINISH(save, bottom_old, size_old) ((void)0)
#endif

namespace mesa_emu {

thread_local uint3 tl_block_idx{0, 0, 0};
thread_local dim3 tl_block_dim{1, 1, 1};
thread_local dim3 tl_grid_dim{1, 1, 1};
thread_local ThreadState* tl_current = nullptr;
thread_local unsigned tl_checks = 0;
thread_local uint64_t tl_block_epoch = 0;
void race_track(void* p, size_t bytes, const char* name);
struct ThreadState;
void resolve_pending_write(ThreadState& t);

namespace {

constexpr size_t kStackBytes = 128 * 1024;
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxGridYZ = 65535;
constexpr unsigned long long kMaxGridX = 2147483647ull;
constexpr unsigned long long kMaxCooperativeBlocks = 512;
constexpr int kLaunchFailure = 719;  // cudaErrorLaunchFailure: a check failed

struct Block;

// ---------------------------------------------------------------------------------------
// Configuration: MESA_EMU_CHECK / MESA_EMU_SEED, read once, unless mesa_emu_set_checks ran.
std::once_flag g_env_once;
std::atomic<uint32_t> g_checks{0};
std::atomic<uint64_t> g_seed{0};

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint32_t parse_checks(const char* s) {
  std::string v(s);
  if (v.empty() || v == "0" || v == "off" || v == "none") return 0;
  if (v == "1" || v == "all" || v == "on") return MESA_EMU_CHECK_ALL;
  uint32_t bits = 0;
  size_t at = 0;
  while (at <= v.size()) {
    size_t end = v.find(',', at);
    if (end == std::string::npos) end = v.size();
    const std::string name = v.substr(at, end - at);
    if (name == "schedule") bits |= MESA_EMU_CHECK_SCHEDULE;
    else if (name == "initcheck" || name == "init") bits |= MESA_EMU_CHECK_INIT;
    else if (name == "memcheck" || name == "mem") bits |= MESA_EMU_CHECK_MEM;
    else if (name == "synccheck" || name == "sync") bits |= MESA_EMU_CHECK_SYNC;
    else if (name == "racecheck" || name == "race") bits |= MESA_EMU_CHECK_RACE;
    else if (name == "bounds") bits |= MESA_EMU_CHECK_BOUNDS;
    else if (name == "benign") bits |= MESA_EMU_CHECK_BENIGN;
    else if (!name.empty()) std::fprintf(stderr, "mesa emulator: MESA_EMU_CHECK: unknown check `%s` ignored\n", name.c_str());
    at = end + 1;
  }
  return bits;
}

void read_env() {
  std::call_once(g_env_once, [] {
    const char* c = std::getenv("MESA_EMU_CHECK");
    if (c != nullptr) g_checks.store(parse_checks(c));
    const char* s = std::getenv("MESA_EMU_SEED");
    if (s != nullptr && *s != '\0') {
      g_seed.store(std::strtoull(s, nullptr, 0));
    } else {
      g_seed.store(splitmix64(uint64_t(std::chrono::steady_clock::now().time_since_epoch().count())) >> 16);
    }
  });
}

uint32_t config_checks() {
  read_env();
  return g_checks.load(std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------
// One launch: what its workers share, and the first failure of a check.
// racecheck of global memory: an emulator allocation seen by a launch, and its shadow.
struct GlobalShadow;
struct RaceRange {
  uintptr_t lo = 0, hi = 0;
  GlobalShadow* shadow = nullptr;
};
// What releases made visible: the releasing block's latest barrier generation and the
// threads that released in it.
using ThreadSet = std::bitset<1024>;  // kMaxThreadsPerBlock
struct Release {
  bool set = false;
  uint32_t gen = 0;
  ThreadSet tids;
};

struct LaunchCtx {
  const char* kernel = "";
  uint32_t checks = 0;
  uint64_t base_seed = 0;
  uint64_t seed = 0;  // of this launch: base seed and launch shape
  uint32_t id = 0;    // distinct per launch: global racecheck's launch boundary
  bool cooperative = false;
  unsigned long long blocks = 0;
  unsigned char poison = 0xff;
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::string report;
  // racecheck: the allocations when the launch began (sorted), and the release clocks of the
  // addresses atomics released to, per releasing block
  std::vector<RaceRange> ranges;
  std::mutex sync_mutex;
  std::unordered_map<uintptr_t, std::unordered_map<uint32_t, Release>> sync_objects;
  // this_grid().sync() of a cooperative launch
  std::mutex grid_mutex;
  unsigned grid_arrived = 0;
  uint64_t grid_generation = 0;
  std::atomic<unsigned long long> blocks_done{0};
};
thread_local LaunchCtx* tl_launch = nullptr;

// Pending report of the launching thread (mesa_emu_take_report).
thread_local std::string tl_report;

}  // namespace

struct ThreadState {
  uint3 idx{0, 0, 0};
#ifdef MESA_EMU_UCONTEXT
  ucontext_t ctx;
#else
  void* sp = nullptr;  // saved stack pointer while switched out
#endif
  bool done = false;
  // 0 running, 1 waiting at __syncthreads, 2 waiting at a warp rendezvous
  int wait = 0;
  uint64_t wait_gen = 0;  // the generation of the barrier or rendezvous waited for
  unsigned wait_key = 0;  // the warp rendezvous waited in (Warp::meet)
  uint64_t barriers = 0;  // __syncthreads passed (synccheck)
  const char* site_file = "";
  int site_line = 0;
  void* asan_fake = nullptr;  // AddressSanitizer's fake stack while switched out
  Block* block = nullptr;
  // racecheck across blocks: a __threadfence not yet followed by an atomic store (which then
  // releases), and the address of the last relaxed atomic load (a later fence acquires it)
  bool fenced = false;
  uintptr_t atomic_read = 0;
  // a write-write conflict whose verdict waits for the store (same value: benign)
  struct PendingWrite {
    bool pending = false;
    uintptr_t addr = 0;
    unsigned size = 0;
    unsigned char before[16];
    std::string what;  // the report, if the values differ
  } ww;
  // barrier divergence: the iteration of each enclosing loop that holds a barrier
  static constexpr unsigned kMaxLoops = 8;
  struct LoopLevel {
    const void* site = nullptr;
    uint32_t iter = 0;
  };
  unsigned loop_depth = 0;
  LoopLevel loops[kMaxLoops];
};

namespace {


// A warp rendezvous (shuffle, vote, __syncwarp, WMMA operation) and its lanes so far.
struct Meet {
  unsigned arrived = 0;
  unsigned arrived_mask = 0;
  unsigned mask = 0;  // of the rendezvous in progress (synccheck)
  const char* what = "";
  uint64_t generation = 0;
};

struct Warp {
  unsigned live = 0;
  unsigned live_mask = 0;  // lanes that exist and have not exited
  // With synccheck, one rendezvous per lowest lane of the mask, so that the tiles of a warp
  // (cooperative_groups::tiled_partition: disjoint masks) meet on their own; without it, one
  // of all live lanes, meet[0].
  Meet meet[32];
  uint32_t used = 0;  // bit k: meet[k] was joined since the block started
  uint32_t speed = 0;  // shuffled schedule: runs in a round when (random & speed) == 0
  // What orders memory within the warp (racecheck): a __syncwarp of every live lane bumps
  // sync_generation; one of part of the warp (a tile's sync) bumps the generation of each of
  // its lanes and records its mask. Shuffles and votes order nothing.
  uint32_t sync_generation = 0;
  uint16_t lane_generation[32] = {};
  uint32_t lane_mask[32] = {};
  // the lanes' values of a shuffle or ballot, in two sets used by alternate rendezvous
  // generations (warp_exchange)
  alignas(16) unsigned char slot[2][32][16];
  // the lanes' parts of a WMMA operation (warp_matrix_op), in two sets as `slot`
  WarpMatrixSlot matrix[2][32];
};

// The fiber stacks of one block: a single mapping of n stacks (one memory map per block,
// whatever its thread count, so that many concurrent blocks stay far below the kernel's
// limit on mappings), cached across launches. A canary word at the low end of every stack is
// checked after the block: an overflow is reported instead of silently corrupting a
// neighbour.
constexpr uint64_t kStackCanary = 0x6d6573615f737461ull;  // "mesa_sta"

struct StackSet {
  unsigned char* base = nullptr;
  size_t count = 0;
  ~StackSet() { unmap(); }
  // Under ASan the fibers' frames leave redzones poisoned in the shadow of this mapping (a
  // frame a fiber never returns from keeps its poison); unmapped as is, the address range
  // could come back as a thread's stack and TLS (the `__shared__` variables), and ASan
  // would report those stale redzones there (seen once: a stack-buffer-underflow in the
  // memset of a cooperative block's shared memory).
  void unmap() {
    if (base == nullptr) return;
#ifdef MESA_EMU_ASAN
    __asan_unpoison_memory_region(base, count * kStackBytes);
#endif
    munmap(base, count * kStackBytes);
  }
  unsigned char* stack(size_t i) const { return base + i * kStackBytes; }
  bool reserve(size_t n) {
    if (n <= count) return true;
    unmap();
    base = nullptr;
    count = 0;
    void* p = mmap(nullptr, n * kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    base = static_cast<unsigned char*>(p);
    count = n;
    return true;
  }
  void arm(size_t n) {
    for (size_t i = 0; i < n; ++i) std::memcpy(stack(i), &kStackCanary, sizeof kStackCanary);
  }
  bool intact(size_t n) const {
    for (size_t i = 0; i < n; ++i)
      if (std::memcmp(stack(i), &kStackCanary, sizeof kStackCanary) != 0) return false;
    return true;
  }
};

std::mutex g_stack_mutex;
std::vector<std::unique_ptr<StackSet>> g_stack_cache;

std::unique_ptr<StackSet> take_stacks() {
  std::lock_guard<std::mutex> lock(g_stack_mutex);
  if (g_stack_cache.empty()) return std::make_unique<StackSet>();
  std::unique_ptr<StackSet> s = std::move(g_stack_cache.back());
  g_stack_cache.pop_back();
  return s;
}
void give_stacks(std::unique_ptr<StackSet> s) {
  std::lock_guard<std::mutex> lock(g_stack_mutex);
  // keep enough sets for the usual concurrency; free the rest (cooperative launches and
  // concurrent callers may have needed many at once)
  if (g_stack_cache.size() < 64) g_stack_cache.push_back(std::move(s));
}

struct Block {
#ifdef MESA_EMU_UCONTEXT
  ucontext_t scheduler;
#else
  void* scheduler_sp = nullptr;
#endif
  std::vector<ThreadState> threads;
  std::vector<Warp> warps;
  std::vector<unsigned char> dynamic_smem;
  unsigned live = 0;
  unsigned barrier_arrived = 0;
  uint64_t barrier_generation = 0;
  const char* barrier_file = "";  // call site of the barrier generation in progress
  int barrier_line = 0;
  // the loop iterations of the first thread at the barrier generation in progress (synccheck)
  unsigned barrier_tid = 0;
  unsigned barrier_depth = 0;
  ThreadState::LoopLevel barrier_loops[ThreadState::kMaxLoops];
  uint32_t linear = 0;            // the block's linear index in the grid (racecheck)
  uint16_t grid_generation = 0;   // this_grid().sync() passed (racecheck)
  uint64_t progress = 0;  // bumped by every arrival, release, exit and voluntary yield
  uint64_t rng = 0;       // the schedule's generator (xorshift64*)
  bool abort = false;     // a check failed: stop running this block
  const std::function<void()>* body = nullptr;
  // AddressSanitizer: the scheduler's stack and fake stack, and the fiber stacks' base
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
  void* sched_fake = nullptr;

  uint64_t next_random() {
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 0x2545f4914f6cdd1dull;
  }
};

thread_local Block* tl_block = nullptr;

unsigned linear_tid(const ThreadState* t) {
  return t->idx.x + t->idx.y * tl_block_dim.x + t->idx.z * tl_block_dim.x * tl_block_dim.y;
}

const char* check_name(uint32_t bit) {
  switch (bit) {
    case MESA_EMU_CHECK_SCHEDULE: return "schedule";
    case MESA_EMU_CHECK_INIT: return "initcheck";
    case MESA_EMU_CHECK_MEM: return "memcheck";
    case MESA_EMU_CHECK_SYNC: return "synccheck";
    case MESA_EMU_CHECK_RACE: return "racecheck";
    case MESA_EMU_CHECK_BOUNDS: return "bounds";
    case MESA_EMU_CHECK_BENIGN: return "benign";
    default: return "emulator";
  }
}

// Records the first failure of the launch: "<check>: kernel `k` [block (x,y,z) thread (x,y,z)]:
// what; seed". Safe from any worker.
void record_failure(LaunchCtx& l, uint32_t check, const std::string& what, bool in_block) {
  char where[160] = "";
  if (in_block) {
    if (tl_current != nullptr) {
      std::snprintf(where, sizeof where, " block (%u,%u,%u) thread (%u,%u,%u)", tl_block_idx.x, tl_block_idx.y,
                    tl_block_idx.z, tl_current->idx.x, tl_current->idx.y, tl_current->idx.z);
    } else {
      std::snprintf(where, sizeof where, " block (%u,%u,%u)", tl_block_idx.x, tl_block_idx.y, tl_block_idx.z);
    }
  }
  char seed[160];
  std::snprintf(seed, sizeof seed, " [replay: MESA_EMU_SEED=%llu MESA_EMU_THREADS=1; launch seed 0x%016llx]",
                (unsigned long long)l.base_seed, (unsigned long long)l.seed);
  std::string msg = std::string("mesa emulator ") + check_name(check) + ": kernel `" + l.kernel + "`" + where + ": " +
                    what + seed;
  std::lock_guard<std::mutex> lock(l.mutex);
  if (!l.failed.load()) {
    l.report = msg;
    l.failed.store(true);
  }
}

// Ends the calling fiber for good, without unwinding its frames: a failure may come from
// racecheck's callbacks, which the compiler declares nothrow (an exception could not pass
// them), and the kernel's frames hold nothing whose destructor matters. The block is
// abandoned (abort), so nothing waits for this thread.
[[noreturn]] void abandon_fiber() {
  ThreadState* self = tl_current;
  Block& b = *self->block;
  self->done = true;
  b.live -= 1;
  b.progress += 1;
#ifdef MESA_EMU_UCONTEXT
  setcontext(&b.scheduler);
#else
  void* dead_sp = nullptr;
  MESA_ASAN_START(nullptr, b.sched_bottom, b.sched_size);  // this stack is done
  mesa_emu_switch(&dead_sp, b.scheduler_sp);
#endif
  std::abort();  // an abandoned fiber is never resumed
}

// A check failed inside a block: record it, stop the block, end the calling thread.
[[noreturn]] void fail_in_block(uint32_t check, const std::string& what) {
  if (tl_launch != nullptr) record_failure(*tl_launch, check, what, true);
  if (tl_block != nullptr) tl_block->abort = true;
  abandon_fiber();
}

std::string lanes_text(unsigned mask) {
  std::string s;
  for (unsigned l = 0; l < 32;) {
    if (!((mask >> l) & 1u)) {
      ++l;
      continue;
    }
    unsigned e = l;
    while (e + 1 < 32 && ((mask >> (e + 1)) & 1u)) ++e;
    if (!s.empty()) s += ",";
    s += std::to_string(l);
    if (e > l) s += "-" + std::to_string(e);
    l = e + 1;
  }
  return s.empty() ? "none" : s;
}

std::string hex32(unsigned v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

std::string hex64(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%llx", (unsigned long long)v);
  return b;
}

void fiber_body() {
  ThreadState* self = tl_current;
  (*self->block->body)();  // a failed check leaves through abandon_fiber instead
  if (self->ww.pending) resolve_pending_write(*self);
  self->done = true;
  self->block->live -= 1;
  self->block->progress += 1;
}

#ifdef MESA_EMU_UCONTEXT
void fiber_entry() { fiber_body(); }  // returning resumes the scheduler through uc_link
#else
[[noreturn]] void fiber_start() {
  MESA_ASAN_FINISH(nullptr, &tl_current->block->sched_bottom, &tl_current->block->sched_size);
  fiber_body();
  ThreadState* self = tl_current;
  void* dead_sp = nullptr;
  MESA_ASAN_START(nullptr, self->block->sched_bottom, self->block->sched_size);  // this stack is done
  mesa_emu_switch(&dead_sp, self->block->scheduler_sp);
  std::abort();  // a finished fiber is never resumed
}

// Lays out a fresh stack so that switching to it enters fiber_start. The stacks are
// kStackBytes apart, a multiple of every cache's set stride: the tops of all of a block's
// fibers would share a handful of L1 and L2 sets and evict each other at every switch. Fiber
// i's stack starts below its top by (9 · i mod 256) cache lines (at most 16 KiB of its
// 128 KiB), so up to 256 fibers' hot frames land in distinct sets (no speed change was
// measurable on the training example; the warp-by-warp schedule below is what helped).
void* prepare_stack(unsigned char* base, size_t bytes, unsigned fiber) {
  const uintptr_t stagger = uintptr_t((9u * fiber) % 256u) * 64u;
  uintptr_t top = (reinterpret_cast<uintptr_t>(base) + bytes - stagger) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
#if defined(__x86_64__)
  *--sp = nullptr;  // keeps rsp % 16 == 8 at fiber_start's entry, as after a call
  *--sp = reinterpret_cast<void*>(&fiber_start);  // return address
  for (int i = 0; i < 6; ++i) *--sp = nullptr;    // rbp rbx r12 r13 r14 r15
#elif defined(__aarch64__)
  sp -= 0xb0 / sizeof(void*);
  std::memset(sp, 0, 0xb0);
  sp[11] = reinterpret_cast<void*>(&fiber_start);  // x30 (link register) at offset 0x58
#endif
  return sp;
}
#endif

// The deadlock report: every live thread waits and a whole round changed nothing.
std::string deadlock_text(const Block& b) {
  std::string s = "deadlock: every live thread waits and none can proceed:";
  unsigned at_block = 0;
  for (const ThreadState& t : b.threads)
    if (!t.done && t.wait == 1) ++at_block;
  if (at_block > 0)
    s += " " + std::to_string(at_block) + " thread(s) at __syncthreads (" + b.barrier_file + ":" +
         std::to_string(b.barrier_line) + ") of " + std::to_string(b.live) + " live;";
  for (size_t w = 0; w < b.warps.size(); ++w) {
    for (const Meet& m : b.warps[w].meet) {
      if (m.arrived == 0) continue;
      s += " warp " + std::to_string(w) + ": lanes " + lanes_text(m.arrived_mask) + " in " + m.what + " with mask " +
           hex32(m.mask) + ", lanes " + lanes_text(m.mask & ~m.arrived_mask) + " of the mask elsewhere;";
    }
  }
  return s;
}

// True when thread i of b waits and its barrier or rendezvous cannot have completed: then
// resuming it would only make it yield again.
bool still_waiting(const Block& b, const ThreadState& t, unsigned i) {
  if (t.wait == 1) return b.barrier_generation == t.wait_gen && b.barrier_arrived < b.live;
  const Warp& w = b.warps[i / 32];
  const Meet& m = w.meet[t.wait_key];
  if (m.generation != t.wait_gen) return false;
  if (tl_checks & kCheckSync) {
    if ((m.mask & ~w.live_mask) != 0) return false;  // to be reported by the waiter
    return m.arrived < unsigned(__builtin_popcount(m.mask));
  }
  return m.arrived < w.live;
}

// The block's floating-point control state: the default of the C ABI (round to nearest, all
// exceptions masked, no flush to zero) while the block runs, whatever the calling thread set;
// the caller's state back afterwards.
struct FpEnvironment {
#if defined(__x86_64__)
  uint32_t mxcsr = 0;
  uint16_t fcw = 0;
  FpEnvironment() {
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fcw));
    const uint32_t block_mxcsr = 0x1f80;
    const uint16_t block_fcw = 0x037f;
    asm volatile("ldmxcsr %0" : : "m"(block_mxcsr));
    asm volatile("fldcw %0" : : "m"(block_fcw));
  }
  ~FpEnvironment() {
    asm volatile("ldmxcsr %0" : : "m"(mxcsr));
    asm volatile("fldcw %0" : : "m"(fcw));
  }
#else
  FpEnvironment() {}  // AArch64's switch saves FPCR; ucontext saves the whole state
#endif
  FpEnvironment(const FpEnvironment&) = delete;
  FpEnvironment& operator=(const FpEnvironment&) = delete;
};

void block_race_start(Block& b);

// Runs one block to completion on the calling OS thread.
void run_block(Block& b, StackSet& stacks, uint3 block_idx, unsigned long long linear, bool cooperative) {
  const FpEnvironment fp_environment;
  LaunchCtx& l = *tl_launch;
  tl_block_idx = block_idx;
  tl_block = &b;
  tl_checks = l.checks;
  tl_block_epoch += 1;
  const unsigned n = unsigned(b.threads.size());
  b.linear = uint32_t(linear);
  b.grid_generation = 0;
  block_race_start(b);
  b.live = n;
  b.barrier_arrived = 0;
  b.abort = false;
  b.rng = splitmix64(l.seed ^ splitmix64(linear)) | 1u;
  for (unsigned w = 0; w < b.warps.size(); ++w) {
    Warp& wp = b.warps[w];
    wp.live = std::min(32u, n - w * 32u);
    wp.live_mask = wp.live == 32 ? 0xffffffffu : ((1u << wp.live) - 1u);
    for (uint32_t u = wp.used | 1u; u != 0; u &= u - 1) {
      Meet& m = wp.meet[__builtin_ctz(u)];
      m.arrived = 0;
      m.arrived_mask = 0;
    }
    wp.used = 0;
    for (unsigned l = 0; l < 32; ++l) {
      wp.lane_generation[l] = 0;
      wp.lane_mask[l] = 0;
    }
  }
  if ((l.checks & kCheckInit) && !b.dynamic_smem.empty())
    std::memset(b.dynamic_smem.data(), l.poison, b.dynamic_smem.size());
#ifdef MESA_EMU_ASAN
  // the frames of the fibers that ran on these stacks before left their redzones poisoned
  __asan_unpoison_memory_region(stacks.stack(0), size_t(n) * kStackBytes);
#endif
  stacks.arm(n);
  for (unsigned i = 0; i < n; ++i) {
    ThreadState& t = b.threads[i];
    t.done = false;
    t.wait = 0;
    t.barriers = 0;
    t.block = &b;
    t.fenced = false;
    t.atomic_read = 0;
    t.ww.pending = false;
    t.loop_depth = 0;
    for (ThreadState::LoopLevel& level : t.loops) level.site = nullptr;
    t.idx = uint3{i % tl_block_dim.x, (i / tl_block_dim.x) % tl_block_dim.y, i / (tl_block_dim.x * tl_block_dim.y)};
#ifdef MESA_EMU_UCONTEXT
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = stacks.stack(i);
    t.ctx.uc_stack.ss_size = kStackBytes;
    t.ctx.uc_link = &b.scheduler;
    makecontext(&t.ctx, fiber_entry, 0);
#else
    t.sp = prepare_stack(stacks.stack(i), kStackBytes, i);
#endif
  }
  const bool shuffle = (l.checks & kCheckSchedule) != 0;
  // shuffled schedule: each warp gets a speed (runs in every round, or in about one of 2 or
  // 4), so that some threads lag behind others, as a GPU's warps may
  if (shuffle) {
    for (size_t w = 0; w < b.warps.size(); ++w) {
      static constexpr uint32_t kSpeeds[4] = {0u, 0u, 1u, 3u};
      b.warps[w].speed = kSpeeds[b.next_random() % 4];
    }
  }
  bool full_round = true;  // every live thread runs (after a round without progress)
  // the strides coprime with n: a round visits thread (start + k * stride) % n, k = 0..n-1
  unsigned strides[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  if (shuffle) {
    unsigned found = 0;
    for (unsigned c = 1; c < 4 * n + 8 && found < 8; c += 2 + 2 * unsigned(b.next_random() % 8))
      if (std::gcd(c % n == 0 ? 1u : c % n, n) == 1) strides[found++] = c % n == 0 ? 1u : c % n;
  }
  while (b.live > 0 && !b.abort) {
    const uint64_t r = shuffle ? b.next_random() : 0;
    const unsigned start = unsigned((r >> 32) % n), stride = strides[r & 7u];
    const bool full = full_round || !shuffle;
    // one random word decides which warps sit this round out (2 bits per warp)
    const uint64_t skip_bits = full ? 0 : b.next_random();
    const uint64_t progress = b.progress;
    // runs thread i until it waits or finishes (nothing if what it waits for has not changed)
    const auto resume = [&](unsigned i) {
      ThreadState& t = b.threads[i];
      if (t.done) return;
      if (t.wait != 0 && still_waiting(b, t, i)) return;  // nothing it waits for changed
      tl_current = &t;
#ifdef MESA_EMU_UCONTEXT
      swapcontext(&b.scheduler, &t.ctx);
#else
      MESA_ASAN_START(&b.sched_fake, stacks.stack(i), kStackBytes);
      mesa_emu_switch(&b.scheduler_sp, t.sp);
      MESA_ASAN_FINISH(b.sched_fake, nullptr, nullptr);
#endif
      if (t.done) {
        // a finished thread no longer counts towards its warp's exchanges
        Warp& wp = b.warps[i / 32];
        wp.live -= 1;
        wp.live_mask &= ~(1u << (i % 32));
      }
    };
    if (shuffle) {
      unsigned i = start;
      for (unsigned k = 0; k < n && !b.abort; ++k, i = (i + stride) % n) {
        if (!full && ((skip_bits >> (2 * ((i / 32) % 32))) & b.warps[i / 32].speed) != 0) continue;
        resume(i);
      }
    } else {
      // Warp by warp: a warp's lanes run again while one of them was released from a warp
      // rendezvous (shuffle, ballot, __syncwarp), so a warp's chain of shuffles runs on the
      // 32 stacks of its lanes, hot in cache, instead of on every stack of the block in turn
      // (the switch's first load from a cold stack was a quarter of the emulator's time).
      // A warp leaves its turn when its lanes wait for others (__syncthreads, spin-waits).
      for (unsigned w0 = 0; w0 < n && !b.abort; w0 += 32) {
        const unsigned w_end = std::min(n, w0 + 32);
        for (bool again = true; again && !b.abort;) {
          for (unsigned i = w0; i < w_end && !b.abort; ++i) resume(i);
          again = false;
          for (unsigned i = w0; i < w_end && !again; ++i) {
            const ThreadState& t = b.threads[i];
            again = !t.done && t.wait == 2 && !still_waiting(b, t, i);
          }
        }
      }
    }
    tl_current = nullptr;
    if (b.abort) break;
    full_round = b.progress == progress;
    if (full && b.live > 0 && b.progress == progress) {
      bool all_wait = true;
      for (const ThreadState& t : b.threads)
        if (!t.done && t.wait == 0) all_wait = false;
      if (all_wait) {
        record_failure(l, MESA_EMU_CHECK_SYNC, deadlock_text(b), true);
        b.abort = true;
        break;
      }
    }
    if (cooperative) std::this_thread::yield();
  }
  tl_current = nullptr;
  if (!b.abort && (l.checks & kCheckSync)) {
    // every thread passes the same number of __syncthreads (CUDA: a barrier in conditional
    // code only if the condition is the same for the whole block)
    const ThreadState& t0 = b.threads[0];
    for (unsigned i = 1; i < n; ++i) {
      const ThreadState& t = b.threads[i];
      if (t.barriers != t0.barriers) {
        record_failure(l,
                       MESA_EMU_CHECK_SYNC,
                       "__syncthreads reached by part of the block: thread (" + std::to_string(t0.idx.x) + "," +
                           std::to_string(t0.idx.y) + "," + std::to_string(t0.idx.z) + ") passed " +
                           std::to_string(t0.barriers) + " barrier(s), thread (" + std::to_string(t.idx.x) + "," +
                           std::to_string(t.idx.y) + "," + std::to_string(t.idx.z) + ") passed " +
                           std::to_string(t.barriers),
                       true);
        b.abort = true;
        break;
      }
    }
  }
  if (!stacks.intact(n)) {
    std::fprintf(stderr, "mesa emulator: a kernel overflowed its %zu-byte fiber stack\n", kStackBytes);
    std::abort();
  }
  tl_block = nullptr;
  tl_checks = 0;
}

void yield_to_scheduler() {
  ThreadState* self = tl_current;
  if (self->ww.pending) resolve_pending_write(*self);
#ifdef MESA_EMU_UCONTEXT
  swapcontext(&self->ctx, &self->block->scheduler);
#else
  Block& b = *self->block;
  MESA_ASAN_START(&self->asan_fake, b.sched_bottom, b.sched_size);
  mesa_emu_switch(&self->sp, b.scheduler_sp);
  MESA_ASAN_FINISH(self->asan_fake, &b.sched_bottom, &b.sched_size);
#endif
}

int env_threads() {
  const char* s = std::getenv("MESA_EMU_THREADS");
  if (s != nullptr) {
    const int v = std::atoi(s);
    if (v > 0) return v < 256 ? v : 256;  // more workers than this only costs fiber stacks
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : int(hw);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// racecheck: the kernels are compiled with GCC's -fsanitize=thread instrumentation, whose
// callbacks (__tsan_read4, __tsan_write8, __tsan_atomic32_fetch_add, ... below) this runtime
// implements itself — no ThreadSanitizer runtime is linked. Outside a block with racecheck or
// memcheck on they return at once. Inside:
//  * __shared__ memory (tracked variables and the dynamic shared memory): a shadow word per 4
//    bytes with the last writer and reader (thread, block barrier generation, warp __syncwarp
//    generation) and which bytes a thread of this block wrote. Two accesses of different
//    threads, one a write, conflict unless a __syncthreads lies between them, or, in one
//    warp, a __syncwarp (Volta's rule: lanes of a warp are not in lockstep). Shuffles and
//    ballots order no memory, as on the GPU.
//  * global memory (every emulator allocation): a shadow entry per 2 bytes and launch with
//    the last writer and reader (block, thread, barrier and __syncwarp generations, grid syncs
//    passed, atomic or not, the bytes touched, the instruction). Two accesses of different
//    threads, one a write, not both atomic, conflict unless ordered: in one block as above;
//    across blocks by a grid sync of a cooperative launch, or by a release the later block
//    acquired (below); across launches always (the launch boundary).
//  * release and acquire, per block: an atomic store or read-modify-write with release order,
//    or after a __threadfence of its thread, releases everything its block did before its
//    barrier generation, and the thread's own accesses; an atomic load or read-modify-write
//    with acquire order, or a relaxed one followed by a __threadfence of its thread, acquires
//    what was released to that address, for itself at once and for its block after the next
//    __syncthreads. (CUDA's fence-plus-flag pattern, threadFenceReduction, atomic_ref.)
//  * a write-write conflict waits for the store: when it left the bytes that were there (both
//    threads stored the same value) it is "benign" (its own check), otherwise a race.
//  * memcheck: a store into __constant__ memory (the section cuda_emu.h puts it in).
namespace {

// A 32-bit offset of an instruction from this function's code: the source line of an access
// (symbolised when the report is made, in launch()).
int32_t pc_offset(uintptr_t pc) {
  const intptr_t d = intptr_t(pc) - intptr_t(reinterpret_cast<uintptr_t>(&pc_offset));
  return d > INT32_MIN && d <= INT32_MAX ? int32_t(d) : INT32_MIN;
}
std::string pc_text(int32_t off) {
  if (off == INT32_MIN) return "an unknown line";
  char b[48];
  std::snprintf(b, sizeof b, "{pc:%llx}",
                (unsigned long long)(reinterpret_cast<uintptr_t>(&pc_offset) + intptr_t(off)));
  return b;
}

std::string tid_text(unsigned tid) {
  const unsigned x = tl_block_dim.x, y = tl_block_dim.y;
  return "(" + std::to_string(tid % x) + "," + std::to_string((tid / x) % y) + "," + std::to_string(tid / (x * y)) + ")";
}
std::string block_text(uint32_t linear) {
  const unsigned x = tl_grid_dim.x, y = tl_grid_dim.y;
  return "(" + std::to_string(linear % x) + "," + std::to_string((linear / x) % y) + "," +
         std::to_string(linear / (1ull * x * y)) + ")";
}

// A write-write conflict: the verdict after the store (resolve_pending_write).
void defer_write_write(ThreadState& t, uintptr_t a, size_t size, std::string what) {
  if (t.ww.pending) return;  // one at a time: the first decides
  t.ww.pending = true;
  t.ww.addr = a;
  t.ww.size = unsigned(std::min<size_t>(size, sizeof t.ww.before));
  std::memcpy(t.ww.before, reinterpret_cast<const void*>(a), t.ww.size);
  t.ww.what = std::move(what);
}

// The warp-order stamp of a lane (racecheck): its warp's count of whole-warp __syncwarps in
// the high 16 bits, its own count of partial ones (tile syncs) in the low 16.
uint32_t warp_stamp(const Warp& w, unsigned lane) {
  return (w.sync_generation << 16) | w.lane_generation[lane];
}
// Whether an access with stamp p by lane pl is ordered before one with stamp c by lane cl of
// the same warp and barrier generation: a whole-warp __syncwarp between them, or a partial one
// (the last of lane cl's) that held lane pl too.
bool warp_ordered(const Warp& w, uint32_t p, unsigned pl, uint32_t c, unsigned cl) {
  if ((p >> 16) != (c >> 16)) return true;
  return ((w.lane_mask[cl] >> pl) & 1u) != 0 && (p & 0xffffu) != (c & 0xffffu);
}

struct Shadow {
  uint64_t epoch = 0;  // tl_block_epoch of the entry; older entries count as empty
  uint64_t w_gen = 0, r_gen = 0;
  uint32_t w_wgen = 0, r_wgen = 0;
  int32_t w_pc = INT32_MIN, r_pc = INT32_MIN;
  uint16_t w_tid = 0, r_tid = 0, r_warp = 0;
  uint8_t written = 0;  // bytes of the granule written in this block
  bool has_writer = false, has_reader = false;
  bool r_multi_warp = false;  // readers of this generation in more than one warp
  bool r_many = false;        // another reader than r_tid at (r_warp, r_wgen)
  bool w_atomic = false;      // the last write was an atomic
  bool r_atomic = false;      // every read since the last write was atomic
};

struct Tracked {
  uintptr_t lo = 0, hi = 0;
  const char* name = "";
  std::vector<Shadow>* shadow = nullptr;
};

constexpr int kMaxTracked = 16;
thread_local Tracked tl_tracked[kMaxTracked];
thread_local int tl_ntracked = 0;
thread_local uint64_t tl_tracked_epoch = 0;
// The span of this block's tracked variables: most instrumented accesses (global memory,
// a thread's own arrays) fall outside it and return before race_access is called.
thread_local uintptr_t tl_tracked_lo = UINTPTR_MAX, tl_tracked_hi = 0;
// per OS thread, freed when it ends (helper threads end with their launch)
thread_local std::unique_ptr<std::map<uintptr_t, std::vector<Shadow>>> tl_shadow_store;

}  // namespace

void race_track(void* p, size_t bytes, const char* name) {
  if (tl_tracked_epoch != tl_block_epoch) {
    tl_tracked_epoch = tl_block_epoch;
    tl_ntracked = 0;
    tl_tracked_lo = UINTPTR_MAX;
    tl_tracked_hi = 0;
  }
  if (tl_ntracked == kMaxTracked || bytes == 0) return;  // more variables than tracked: the rest go unseen
  if (tl_shadow_store == nullptr) tl_shadow_store = std::make_unique<std::map<uintptr_t, std::vector<Shadow>>>();
  std::vector<Shadow>& sh = (*tl_shadow_store)[reinterpret_cast<uintptr_t>(p)];
  const size_t granules = (bytes + 3) / 4;
  if (sh.size() < granules) sh.resize(granules);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p), hi = lo + bytes;
  tl_tracked[tl_ntracked++] = Tracked{lo, hi, name, &sh};
  tl_tracked_lo = std::min(tl_tracked_lo, lo);
  tl_tracked_hi = std::max(tl_tracked_hi, hi);
}

void resolve_pending_write(ThreadState& t) {
  t.ww.pending = false;
  const bool same = std::memcmp(reinterpret_cast<const void*>(t.ww.addr), t.ww.before, t.ww.size) == 0;
  if (!same) fail_in_block(MESA_EMU_CHECK_RACE, "write-after-write race " + t.ww.what);
  if (tl_checks & kCheckBenign)
    fail_in_block(MESA_EMU_CHECK_BENIGN,
                  "benign write-write race (both stores wrote the same bytes) " + t.ww.what);
}

namespace {

[[noreturn]] void race_report(const Tracked& t, uintptr_t a, const char* kind, unsigned other, bool now_write,
                              int32_t now_pc, int32_t other_pc) {
  fail_in_block(MESA_EMU_CHECK_RACE, std::string(kind) + " on __shared__ `" + t.name + "` (byte " +
                                         std::to_string(a - t.lo) + " of " + std::to_string(t.hi - t.lo) +
                                         "): this thread " + (now_write ? "writes" : "reads") + " at " +
                                         pc_text(now_pc) + ", thread " + tid_text(other) + " accessed it at " +
                                         pc_text(other_pc) + " with no barrier between");
}

// An access to __shared__ memory (atomic: by an atomic operation, which races with no other
// atomic one); false when `a` is in no tracked variable.
bool race_access(uintptr_t a, size_t size, bool write, int32_t pc, bool atomic) {
  if (tl_tracked_epoch != tl_block_epoch) return false;
  const Tracked* t = nullptr;
  for (int k = 0; k < tl_ntracked; ++k)
    if (a >= tl_tracked[k].lo && a < tl_tracked[k].hi) {
      t = &tl_tracked[k];
      break;
    }
  if (t == nullptr) return false;
  Block& b = *tl_block;
  ThreadState& self = *tl_current;
  const unsigned tid = linear_tid(&self);
  const unsigned warp = tid / 32;
  const uint64_t gen = b.barrier_generation;
  const Warp& wp = b.warps[warp];
  const uint32_t wgen = warp_stamp(wp, tid % 32);
  auto unordered = [&](unsigned other, uint64_t ogen, uint32_t owgen) {
    return other != tid && ogen == gen && (other / 32 != warp || !warp_ordered(wp, owgen, other % 32, wgen, tid % 32));
  };
  const uintptr_t end = std::min<uintptr_t>(a + size, t->hi);
  for (uintptr_t g = (a - t->lo) / 4; t->lo + g * 4 < end; ++g) {
    Shadow& s = (*t->shadow)[g];
    if (s.epoch != tl_block_epoch) s = Shadow{tl_block_epoch};
    const uintptr_t glo = t->lo + g * 4;
    uint8_t bytes = 0;
    for (uintptr_t k = std::max(glo, a); k < std::min(glo + 4, end); ++k) bytes |= uint8_t(1u << (k - glo));
    const bool both_atomic_w = atomic && s.w_atomic;
    if (write) {
      if (s.has_writer && !both_atomic_w && unordered(s.w_tid, s.w_gen, s.w_wgen) && (atomic || s.w_atomic))
        race_report(*t, a, "write-after-write race (one of them atomic)", s.w_tid, true, pc, s.w_pc);
      if (s.has_writer && !both_atomic_w && unordered(s.w_tid, s.w_gen, s.w_wgen))
        defer_write_write(self, a, size,
                          "on __shared__ `" + std::string(t->name) + "` (byte " + std::to_string(a - t->lo) + " of " +
                              std::to_string(t->hi - t->lo) + "): this thread writes at " + pc_text(pc) +
                              ", thread " + tid_text(s.w_tid) + " wrote it at " + pc_text(s.w_pc) +
                              " with no barrier between");
      if (s.has_reader && s.r_gen == gen && !(atomic && s.r_atomic) &&
          (s.r_multi_warp || s.r_warp != warp ||
           (!warp_ordered(wp, s.r_wgen, s.r_tid % 32, wgen, tid % 32) && (s.r_many || s.r_tid != tid))))
        race_report(*t, a, "write-after-read race", s.r_tid, true, pc, s.r_pc);
      s.has_writer = true;
      s.w_atomic = atomic;
      s.w_tid = uint16_t(tid);
      s.w_gen = gen;
      s.w_wgen = wgen;
      s.w_pc = pc;
      s.has_reader = false;
      s.written |= bytes;
    } else {
      if ((tl_checks & kCheckInit) && (s.written & bytes) != bytes)
        fail_in_block(MESA_EMU_CHECK_INIT, std::string("reads byte ") + std::to_string(a - t->lo) + " of __shared__ `" +
                                               t->name + "`, which no thread of this block has written");
      if (s.has_writer && !both_atomic_w && unordered(s.w_tid, s.w_gen, s.w_wgen))
        race_report(*t, a, "read-after-write race", s.w_tid, false, pc, s.w_pc);
      s.r_atomic = (s.has_reader && s.r_gen == gen ? s.r_atomic : true) && atomic;
      if (!s.has_reader || s.r_gen != gen) {
        s.has_reader = true;
        s.r_gen = gen;
        s.r_multi_warp = false;
        s.r_warp = uint16_t(warp);
        s.r_wgen = wgen;
        s.r_tid = uint16_t(tid);
        s.r_many = false;
      } else if (warp != s.r_warp) {
        s.r_multi_warp = true;
      } else if (warp_ordered(wp, s.r_wgen, s.r_tid % 32, wgen, tid % 32)) {  // after a __syncwarp of the two
        s.r_wgen = wgen;
        s.r_tid = uint16_t(tid);
        s.r_many = false;
      } else if (tid != s.r_tid) {
        s.r_many = true;
      }
      s.r_pc = pc;
    }
  }
  return true;
}

// --- global memory ---------------------------------------------------------------------

// Who accessed: block (linear), thread (linear in the block), the block's barrier generation,
// the lane's warp-order stamp (warp_stamp) and the block's grid syncs (modulo 2^16: compared
// for equality only).
struct Actor {
  uint32_t block = 0, gen = 0, wgen = 0;
  uint16_t tid = 0, grid = 0;
};

Actor current_actor() {
  const Block& b = *tl_block;
  const unsigned tid = linear_tid(tl_current);
  return Actor{b.linear, uint32_t(b.barrier_generation), warp_stamp(b.warps[tid / 32], tid % 32), uint16_t(tid),
               b.grid_generation};
}

struct GlobalShadow {
  uint32_t launch;  // LaunchCtx::id of the entry; others count as empty
  uint32_t w_block, r_block;
  uint32_t w_gen, r_gen;
  uint32_t w_wgen, r_wgen;
  int32_t w_pc, r_pc;
  uint16_t w_tid, r_tid;
  uint16_t w_grid, r_grid;
  uint8_t flags;
  uint8_t w_bytes, r_bytes;  // which bytes of the entry the recorded writer and readers touched
};

enum : uint8_t {
  kHasWriter = 1,
  kWriterAtomic = 2,
  kHasReader = 4,
  kReadersAtomic = 8,       // every read since the write was atomic
  kReadersMany = 16,        // other threads of the reader's warp read at its generations
  kReadersMultiWarp = 32,   // threads of several warps of the reader's block
  kReadersOtherBlock = 64,  // a block other than the recorded reader's read since the write
};

Actor writer_of(const GlobalShadow& s) { return Actor{s.w_block, s.w_gen, s.w_wgen, s.w_tid, s.w_grid}; }
Actor reader_of(const GlobalShadow& s) { return Actor{s.r_block, s.r_gen, s.r_wgen, s.r_tid, s.r_grid}; }

// Spin locks over the shadow entries, one per 64 bytes of memory (hashed): an entry is touched
// by the blocks of a launch, which run on several OS threads. An access (at most 16 bytes)
// takes the lock of its first byte and, when it crosses into the next 64 bytes, that one's too
// (in address order). Held for a few instructions, never across a fiber switch.
std::atomic<uint8_t> g_shadow_locks[4096];
std::atomic<uint8_t>& shadow_lock_of(uintptr_t a) { return g_shadow_locks[((a >> 6) ^ (a >> 18)) & 4095u]; }
struct ShadowLock {
  std::atomic<uint8_t>* l[2] = {nullptr, nullptr};
  ShadowLock(uintptr_t a, uintptr_t end) {
    l[0] = &shadow_lock_of(a);
    if (((end - 1) >> 6) != (a >> 6) && &shadow_lock_of(end - 1) != l[0]) l[1] = &shadow_lock_of(end - 1);
    if (l[1] != nullptr && l[1] < l[0]) std::swap(l[0], l[1]);  // one order: no deadlock
    for (std::atomic<uint8_t>* x : l)
      if (x != nullptr)
        while (x->exchange(1, std::memory_order_acquire) != 0) {
        }
  }
  ~ShadowLock() {
    for (std::atomic<uint8_t>* x : l)
      if (x != nullptr) x->store(0, std::memory_order_release);
  }
  ShadowLock(const ShadowLock&) = delete;
  ShadowLock& operator=(const ShadowLock&) = delete;
};

// What this block acquired, per releasing block: the release's generation and thread, and
// where the acquire happened (visible to that thread at once, to the block after a barrier).
struct Acquired {
  uint32_t rel_gen = 0;  // the release's generation and threads
  ThreadSet rel_tids;
  uint32_t acq_gen = 0;  // the earliest acquire's generation, and the acquiring threads
  ThreadSet acq_tids;
};
thread_local std::unordered_map<uint32_t, Acquired> tl_acquired;

// Whether access p (of `many` threads: 0 one, 1 several of its warp, 2 several warps) is
// ordered before access c of the running thread.
bool ordered(const Actor& p, int many, const Actor& c) {
  if (p.block == c.block) {
    if (p.gen != c.gen) return true;
    if (many == 0 && p.tid == c.tid) return true;
    if (many == 2 || p.tid / 32 != c.tid / 32) return false;
    return warp_ordered(tl_block->warps[c.tid / 32], p.wgen, p.tid % 32, c.wgen, c.tid % 32);
  }
  if (p.grid != c.grid) return true;
  const auto it = tl_acquired.find(p.block);
  if (it == tl_acquired.end()) return false;
  const Acquired& q = it->second;
  const bool covered = p.gen < q.rel_gen || (many == 0 && p.gen == q.rel_gen && q.rel_tids.test(p.tid));
  const bool visible = q.acq_tids.test(c.tid) || c.gen > q.acq_gen;
  return covered && visible;
}

// The allocations every launch with racecheck sees (mesa_emu_alloc registers, mesa_emu_free
// unregisters); a shadow is made when a launch first needs it and freed when no such launch
// runs (another host thread may free an allocation while a launch that saw it runs).
struct RaceAlloc {
  size_t bytes = 0;
  GlobalShadow* shadow = nullptr;
};
// Global memory is shadowed per 2 bytes, 48 bytes of shadow per entry (24 times the
// allocation, made as the kernels touch it); larger allocations than this go unchecked. An
// entry records which of its bytes the writer and the readers touched: 8-bit elements of two
// threads in one entry do not conflict (the entry then remembers the last writer's byte only,
// so a conflict on the other byte can go unseen), except two threads' reads and writes of
// neighbouring bytes in one barrier generation (an in-place update of 8-bit elements).
constexpr size_t kGlobalGranule = 2;
constexpr size_t kMaxShadowedBytes = size_t(32) << 20;
std::mutex g_race_mutex;
std::map<uintptr_t, RaceAlloc> g_race_allocs;
std::vector<GlobalShadow*> g_race_graveyard;
unsigned g_race_launches = 0;
std::atomic<uint32_t> g_launch_ids{0};

void race_register(void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_race_mutex);
  g_race_allocs[reinterpret_cast<uintptr_t>(p)] = RaceAlloc{bytes, nullptr};
}

void race_unregister(void* p) {
  std::lock_guard<std::mutex> lock(g_race_mutex);
  const auto it = g_race_allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_race_allocs.end()) return;
  if (it->second.shadow != nullptr) {
    if (g_race_launches == 0) std::free(it->second.shadow);
    else g_race_graveyard.push_back(it->second.shadow);
  }
  g_race_allocs.erase(it);
}

void race_launch_begin(LaunchCtx& l) {
  std::lock_guard<std::mutex> lock(g_race_mutex);
  g_race_launches += 1;
  l.ranges.reserve(g_race_allocs.size());
  for (auto& [addr, alloc] : g_race_allocs) {
    if (alloc.bytes > kMaxShadowedBytes) continue;
    if (alloc.shadow == nullptr)
      alloc.shadow = static_cast<GlobalShadow*>(
          std::calloc((alloc.bytes + kGlobalGranule - 1) / kGlobalGranule, sizeof(GlobalShadow)));
    if (alloc.shadow != nullptr) l.ranges.push_back(RaceRange{addr, addr + alloc.bytes, alloc.shadow});
  }
}

void race_launch_end() {
  std::lock_guard<std::mutex> lock(g_race_mutex);
  g_race_launches -= 1;
  if (g_race_launches == 0) {
    for (GlobalShadow* s : g_race_graveyard) std::free(s);
    g_race_graveyard.clear();
  }
}

// The last allocations this OS thread found (a kernel reads and writes a few buffers).
constexpr int kRangeCache = 4;
thread_local RaceRange tl_range_hit[kRangeCache];
thread_local uint32_t tl_range_launch = 0;
thread_local unsigned tl_range_next = 0;

const RaceRange* find_range(uintptr_t a) {
  const LaunchCtx& l = *tl_launch;
  if (tl_range_launch != l.id) {
    for (RaceRange& r : tl_range_hit) r = RaceRange{};
    tl_range_launch = l.id;
  }
  for (const RaceRange& r : tl_range_hit)
    if (a >= r.lo && a < r.hi) return r.shadow != nullptr ? &r : nullptr;
  const auto next = std::upper_bound(l.ranges.begin(), l.ranges.end(), a,
                                     [](uintptr_t x, const RaceRange& r) { return x < r.lo; });
  RaceRange& slot = tl_range_hit[tl_range_next++ % kRangeCache];
  if (next != l.ranges.begin() && a < std::prev(next)->hi) {
    slot = *std::prev(next);
    return &slot;
  }
  // a gap between allocations (a fiber's stack, the kernel's arguments, host memory): cached
  // too, as a range without shadow
  slot = RaceRange{next == l.ranges.begin() ? 0 : std::prev(next)->hi,
                   next == l.ranges.end() ? UINTPTR_MAX : next->lo, nullptr};
  return nullptr;
}

std::string global_where(const RaceRange& r, uintptr_t a) {
  return "global memory (byte " + std::to_string(a - r.lo) + " of a " + std::to_string(r.hi - r.lo) +
         "-byte emulator allocation at " + hex64(r.lo) + ")";
}
std::string other_text(const Actor& o, int many) {
  std::string s = many == 0   ? "thread " + tid_text(o.tid)
                  : many == 1 ? "several threads of warp " + std::to_string(o.tid / 32)
                              : "threads of several warps";
  if (o.block != tl_block->linear) s += " of block " + block_text(o.block);
  return s;
}

// An access to global memory (an emulator allocation; anything else returns at once).
void global_access(uintptr_t a, size_t size, bool write, bool atomic, int32_t pc) {
  const RaceRange* r = find_range(a);
  if (r == nullptr) return;
  const uint32_t launch = tl_launch->id;
  const Actor me = current_actor();
  std::string race;  // a report to fail with
  std::string ww;    // a write-write conflict, to be judged after the store
  const uintptr_t end = std::min<uintptr_t>(a + size, r->hi);
  {  // the shadow entries of [a, end), under their locks
    const ShadowLock lock(a, end);
    for (uintptr_t g = (a - r->lo) / kGlobalGranule; r->lo + g * kGlobalGranule < end && race.empty(); ++g) {
      GlobalShadow& s = r->shadow[g];
      const uintptr_t glo = r->lo + g * kGlobalGranule;
      uint8_t bytes = 0;
      for (uintptr_t k = std::max(glo, a); k < std::min<uintptr_t>(glo + kGlobalGranule, end); ++k)
        bytes |= uint8_t(1u << (k - glo));
      if (s.launch != launch) {
        s = GlobalShadow{};
        s.launch = launch;
      }
      const bool w_conflict = (s.flags & kHasWriter) && (s.w_bytes & bytes) != 0 &&
                              !(atomic && (s.flags & kWriterAtomic)) && !ordered(writer_of(s), 0, me);
      if (write) {
        if (w_conflict) {
          std::string text = "on " + global_where(*r, a) + ": this thread writes" + (atomic ? " atomically" : "") +
                             " at " + pc_text(pc) + ", " + other_text(writer_of(s), 0) + " wrote it" +
                             ((s.flags & kWriterAtomic) ? " atomically" : "") + " at " + pc_text(s.w_pc) +
                             " with no barrier, grid sync or release/acquire between";
          if (atomic || (s.flags & kWriterAtomic)) race = "write-after-write race " + text;
          else if (ww.empty()) ww = std::move(text);
        }
        if ((s.flags & kHasReader) && (s.r_bytes & bytes) != 0 && !(atomic && (s.flags & kReadersAtomic)) &&
            race.empty()) {
          const int many = (s.flags & kReadersMultiWarp) ? 2 : (s.flags & kReadersMany) ? 1 : 0;
          if (!ordered(reader_of(s), many, me))
            race = "write-after-read race on " + global_where(*r, a) + ": this thread writes" +
                   (atomic ? " atomically" : "") + " at " + pc_text(pc) + ", " + other_text(reader_of(s), many) +
                   " read it at " + pc_text(s.r_pc) + " with no barrier, grid sync or release/acquire between";
        }
        const bool same_writer = (s.flags & kHasWriter) && s.w_block == me.block && s.w_tid == me.tid &&
                                 s.w_gen == me.gen;
        s.w_bytes = same_writer ? uint8_t(s.w_bytes | bytes) : bytes;
        s.w_block = me.block;
        s.w_gen = me.gen;
        s.w_tid = me.tid;
        s.w_wgen = me.wgen;
        s.w_grid = me.grid;
        s.w_pc = pc;
        // the readers of bytes this store left alone stay recorded
        const bool keep_readers = (s.flags & kHasReader) && (s.r_bytes & ~bytes) != 0;
        s.r_bytes = keep_readers ? uint8_t(s.r_bytes & ~bytes) : 0;
        s.flags = uint8_t(kHasWriter | (atomic ? kWriterAtomic : 0) |
                          (keep_readers ? (s.flags & (kHasReader | kReadersAtomic | kReadersMany | kReadersMultiWarp |
                                                     kReadersOtherBlock))
                                        : 0));
      } else {
        if (w_conflict)
          race = "read-after-write race on " + global_where(*r, a) + ": this thread reads" +
                 (atomic ? " atomically" : "") + " at " + pc_text(pc) + ", " + other_text(writer_of(s), 0) +
                 " wrote it" + ((s.flags & kWriterAtomic) ? " atomically" : "") + " at " + pc_text(s.w_pc) +
                 " with no barrier, grid sync or release/acquire between";
        const auto take = [&] {
          s.r_block = me.block;
          s.r_gen = me.gen;
          s.r_tid = me.tid;
          s.r_wgen = me.wgen;
          s.r_grid = me.grid;
        };
        if (!(s.flags & kHasReader)) {
          take();
          s.r_bytes = bytes;
          s.flags = uint8_t((s.flags & (kHasWriter | kWriterAtomic)) | kHasReader | (atomic ? kReadersAtomic : 0));
        } else {
          if (!atomic) s.flags &= uint8_t(~kReadersAtomic);
          if (s.r_block != me.block) {
            take();
            s.r_bytes = bytes;
            s.flags = uint8_t((s.flags & ~(kReadersMany | kReadersMultiWarp)) | kReadersOtherBlock);
          } else if (s.r_gen != me.gen) {
            take();
            s.r_bytes = bytes;
            s.flags &= uint8_t(~(kReadersMany | kReadersMultiWarp));
          } else if (s.r_tid / 32 != me.tid / 32) {
            s.r_bytes |= bytes;
            s.flags |= kReadersMultiWarp;
          } else if (warp_ordered(tl_block->warps[me.tid / 32], s.r_wgen, s.r_tid % 32, me.wgen, me.tid % 32)) {
            take();
            s.r_bytes = bytes;
            s.flags &= uint8_t(~kReadersMany);
          } else if (s.r_tid != me.tid) {
            s.r_bytes |= bytes;
            s.flags |= kReadersMany;
          } else {
            s.r_bytes |= bytes;
          }
        }
        s.r_pc = pc;
      }
    }
  }
  if (!race.empty()) fail_in_block(MESA_EMU_CHECK_RACE, race);
  if (!ww.empty()) defer_write_write(*tl_current, a, size, std::move(ww));
}

void merge_release(Release& r, uint32_t gen, const ThreadSet& tids) {
  if (!r.set || gen > r.gen) {
    r.set = true;
    r.gen = gen;
    r.tids = tids;
  } else if (gen == r.gen) {
    r.tids |= tids;
  }
}

// A release to address a by the running thread (see the section's comment).
void release_to(uintptr_t a) {
  LaunchCtx& l = *tl_launch;
  const Actor me = current_actor();
  std::lock_guard<std::mutex> lock(l.sync_mutex);
  auto& clock = l.sync_objects[a];
  ThreadSet mine;
  mine.set(me.tid);
  merge_release(clock[me.block], me.gen, mine);
  for (const auto& [block, q] : tl_acquired)  // what this thread has acquired, passed on
    if (q.acq_tids.test(me.tid) || me.gen > q.acq_gen) merge_release(clock[block], q.rel_gen, q.rel_tids);
}

// An acquire from address a by the running thread.
void acquire_from(uintptr_t a) {
  LaunchCtx& l = *tl_launch;
  const Actor me = current_actor();
  std::lock_guard<std::mutex> lock(l.sync_mutex);
  const auto it = l.sync_objects.find(a);
  if (it == l.sync_objects.end()) return;
  for (const auto& [block, r] : it->second) {
    if (block == me.block || !r.set) continue;
    const auto [it_q, fresh] = tl_acquired.try_emplace(block);
    Acquired& q = it_q->second;
    if (fresh || r.gen > q.rel_gen) {
      q.rel_gen = r.gen;
      q.rel_tids = r.tids;
      q.acq_gen = me.gen;
      q.acq_tids.reset();
    } else if (r.gen == q.rel_gen) {
      q.rel_tids |= r.tids;
      q.acq_gen = std::min(q.acq_gen, me.gen);
    } else {
      continue;  // an older release than the one acquired before
    }
    q.acq_tids.set(me.tid);
  }
}

// The __constant__ section (cuda_emu.h); null bounds when no kernel declares one.
extern "C" char __start_mesa_emu_constant[] __attribute__((weak));
extern "C" char __stop_mesa_emu_constant[] __attribute__((weak));

bool in_constant(uintptr_t a) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(__start_mesa_emu_constant);
  const uintptr_t hi = reinterpret_cast<uintptr_t>(__stop_mesa_emu_constant);
  return a >= lo && a < hi;
}

[[noreturn]] void constant_store(uintptr_t a, uintptr_t ret) {
  fail_in_block(MESA_EMU_CHECK_MEM, "stores into __constant__ memory (byte " +
                                        std::to_string(a - reinterpret_cast<uintptr_t>(__start_mesa_emu_constant)) +
                                        " of the constant section) at " + pc_text(pc_offset(ret - 1)) +
                                        ": read-only to kernels");
}

// racecheck's part of an access (tl_checks has kCheckRace).
void access_slow(uintptr_t a, size_t size, bool write, bool atomic, uintptr_t ret) {
  ThreadState& self = *tl_current;
  if (self.ww.pending) resolve_pending_write(self);
  if (a >= tl_tracked_lo && a < tl_tracked_hi && race_access(a, size, write, pc_offset(ret - 1), atomic)) return;
  global_access(a, size, write, atomic, pc_offset(ret - 1));
}

inline void on_access(const volatile void* p, size_t size, bool write, uintptr_t ret) {
  if (__builtin_expect((tl_checks & (kCheckRace | kCheckMem)) == 0, 1) || tl_current == nullptr) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(const_cast<const void*>(p));
  if (write && (tl_checks & kCheckMem) && in_constant(a)) constant_store(a, ret);
  if (tl_checks & kCheckRace) access_slow(a, size, write, false, ret);
}

// An atomic operation (mo: the C++ memory order, as __tsan_memory_order numbers it).
inline void on_atomic(const volatile void* p, size_t size, bool read, bool write, int mo, uintptr_t ret) {
  if (__builtin_expect((tl_checks & (kCheckRace | kCheckMem)) == 0, 1) || tl_current == nullptr) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(const_cast<const void*>(p));
  if (write && (tl_checks & kCheckMem) && in_constant(a)) constant_store(a, ret);
  if (!(tl_checks & kCheckRace)) return;
  access_slow(a, size, write, true, ret);
  if (a >= tl_tracked_lo && a < tl_tracked_hi) return;
  ThreadState& self = *tl_current;
  constexpr int kAcquire = 2, kRelease = 3, kAcqRel = 4, kSeqCst = 5;
  // (a fence orders every later atomic store of its thread: each is a release)
  if (write && (mo == kRelease || mo == kAcqRel || mo == kSeqCst || self.fenced)) release_to(a);
  if (read) {
    if (mo == kAcquire || mo == kAcqRel || mo == kSeqCst) acquire_from(a);
    else self.atomic_read = a;
  }
}

void block_race_start(Block& b) {
  if (!tl_acquired.empty()) tl_acquired.clear();
  if ((tl_checks & kCheckRace) && b.dynamic_smem.size() > 16)
    race_track(b.dynamic_smem.data(), b.dynamic_smem.size() - 16, "extern __shared__ (dynamic)");
}

}  // namespace

void threadfence() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  ThreadState* t = tl_current;
  if (t == nullptr || !(tl_checks & kCheckRace)) return;
  t->fenced = true;
  if (t->atomic_read != 0) acquire_from(t->atomic_read);
}

bool launch_is_cooperative() { return tl_launch != nullptr && tl_launch->cooperative; }

void grid_sync(const char* file, int line) {
  LaunchCtx& l = *tl_launch;
  Block& b = *tl_block;
  if (!l.cooperative)
    fail_in_block(MESA_EMU_CHECK_SYNC, std::string("this_grid().sync() at ") + file + ":" + std::to_string(line) +
                                           " in a launch that is not cooperative (blocks that have not started "
                                           "cannot arrive: launch it with MESA_LAUNCH_COOPERATIVE)");
  syncthreads(file, line);
  if (linear_tid(tl_current) == 0) {
    std::unique_lock<std::mutex> lock(l.grid_mutex);
    const uint64_t gen = l.grid_generation;
    if (++l.grid_arrived == l.blocks) {
      l.grid_arrived = 0;
      l.grid_generation += 1;
    } else {
      for (;;) {
        if (l.grid_generation != gen) break;
        if (l.blocks_done.load() > 0) {
          const unsigned long long done = l.blocks_done.load();
          lock.unlock();
          fail_in_block(MESA_EMU_CHECK_SYNC, std::string("this_grid().sync() at ") + file + ":" +
                                                 std::to_string(line) + " reached by part of the grid: " +
                                                 std::to_string(done) + " block(s) finished without it");
        }
        if (l.failed.load()) {
          lock.unlock();
          tl_block->abort = true;  // another block failed a check: end this one too
          abandon_fiber();
        }
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
      }
    }
    b.grid_generation += 1;
  }
  syncthreads(file, line);
}

// Replaces every {pc:ADDR} of a report with the source line of the instruction before ADDR
// (a return address: the instrumented access's call), by addr2line on the module's line
// tables (the kernels are compiled with -g1); "an unknown line" where that fails.
std::string symbolize(const std::string& report) {
  std::string out;
  size_t at = 0;
  while (true) {
    const size_t open = report.find("{pc:", at);
    if (open == std::string::npos) break;
    const size_t close = report.find('}', open);
    if (close == std::string::npos) break;
    out += report.substr(at, open - at);
    const uintptr_t pc = uintptr_t(std::strtoull(report.c_str() + open + 4, nullptr, 16));
    std::string where = "an unknown line";
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(pc), &info) != 0 && info.dli_fname != nullptr) {
      char cmd[1024];
      std::snprintf(cmd, sizeof cmd, "addr2line -i -e '%s' 0x%llx 2>/dev/null", info.dli_fname,
                    (unsigned long long)(pc - reinterpret_cast<uintptr_t>(info.dli_fbase)));
      if (FILE* f = popen(cmd, "r")) {
        // -i: the inlining chain, innermost first (an atomic's line is in libstdc++, then in
        // cuda_emu.h, then in the kernel): the first line of a kernel source, else of
        // kernels/, else the innermost
        std::string first, in_kernels, in_kernel_source;
        char line[512];
        while (std::fgets(line, sizeof line, f) != nullptr) {
          std::string s(line);
          s = s.substr(0, s.find_first_of(" \n"));
          if (s.empty() || s.rfind("??", 0) == 0) continue;
          const size_t k = s.rfind("/kernels/");  // the kernels' own path, as build.rs's #line names it
          if (k != std::string::npos) s = s.substr(k + 1);
          if (first.empty()) first = s;
          if (s.rfind("kernels/", 0) == 0 && in_kernels.empty()) in_kernels = s;
          if (s.rfind("kernels/", 0) == 0 && s.rfind("kernels/emu/", 0) != 0 && in_kernel_source.empty())
            in_kernel_source = s;
        }
        pclose(f);
        if (!in_kernel_source.empty()) where = in_kernel_source;
        else if (!in_kernels.empty()) where = in_kernels;
        else if (!first.empty()) where = first;
      }
    }
    out += where;
    at = close + 1;
  }
  return out + report.substr(at);
}

long long steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int worker_count() {
  static const int n = env_threads();
  return n;
}

const uint3& thread_idx() { return tl_current->idx; }

void yield_thread() {
  if (tl_current != nullptr) {
    tl_block->progress += 1;
    yield_to_scheduler();
  }
}

void memory_point_slow() {
  if (tl_current == nullptr) return;
  Block& b = *tl_block;
  if ((b.next_random() & 3u) == 0) {
    b.progress += 1;
    yield_to_scheduler();
  }
}

void shared_first_pass(void* p, size_t bytes, const char* name) {
  if ((tl_checks & kCheckInit) && tl_launch != nullptr) std::memset(p, tl_launch->poison, bytes);
  if (tl_checks & kCheckRace) race_track(p, bytes, name);
}

void launch_bounds(unsigned max_threads, const char* kernel) {
  if (!(tl_checks & kCheckBounds)) return;
  const unsigned n = tl_block_dim.x * tl_block_dim.y * tl_block_dim.z;
  if (n > max_threads)
    fail_in_block(MESA_EMU_CHECK_BOUNDS, std::string(kernel) + " launched with " + std::to_string(n) +
                                             " threads per block; its __launch_bounds__ allows " +
                                             std::to_string(max_threads) +
                                             " (a GPU refuses the launch: too many resources requested)");
}

namespace {
// Synccheck's rule for barriers in loops: the threads of one barrier generation are in the
// same iteration of every loop around it that holds a barrier (build.rs marks those loops),
// else a thread-dependent trip count or branch lets different iterations meet at one call site.
void check_barrier_loops(Block& b, ThreadState& self, const char* file, int line) {
  const unsigned depth = std::min(self.loop_depth, ThreadState::kMaxLoops);
  if (b.barrier_arrived == 0) {
    b.barrier_tid = linear_tid(&self);
    b.barrier_depth = depth;
    std::copy(self.loops, self.loops + depth, b.barrier_loops);
    return;
  }
  for (unsigned d = 0; d < std::max(depth, b.barrier_depth); ++d) {
    const bool same = d < depth && d < b.barrier_depth && self.loops[d].site == b.barrier_loops[d].site &&
                      self.loops[d].iter == b.barrier_loops[d].iter;
    if (same) continue;
    const unsigned other = b.barrier_tid;
    const auto where = [](unsigned dd, unsigned n, const ThreadState::LoopLevel* levels) {
      return dd < n ? "in iteration " + std::to_string(levels[dd].iter) + " of the loop around it at depth " +
                          std::to_string(dd)
                    : std::string("outside that loop");
    };
    fail_in_block(MESA_EMU_CHECK_SYNC,
                  std::string("__syncthreads at ") + file + ":" + std::to_string(line) +
                      " reached in different iterations of an enclosing loop: this thread " +
                      where(d, depth, self.loops) + ", thread " + std::to_string(other) + " (linear) " +
                      where(d, b.barrier_depth, b.barrier_loops) +
                      " (a barrier in a loop needs the same trip count, and the same branch, in every "
                      "thread of the block)");
  }
}
}  // namespace

void loop_enter(const void* site) {
  ThreadState* t = tl_current;
  if (t == nullptr) return;
  const unsigned d = t->loop_depth;
  if (d < ThreadState::kMaxLoops) {
    ThreadState::LoopLevel& level = t->loops[d];
    if (level.site == site) {
      level.iter += 1;
    } else {
      level.site = site;
      level.iter = 0;
    }
    if (d + 1 < ThreadState::kMaxLoops) t->loops[d + 1].site = nullptr;  // an inner loop starts afresh
  }
  t->loop_depth = d + 1;
}

void loop_leave() {
  ThreadState* t = tl_current;
  if (t != nullptr && t->loop_depth > 0) t->loop_depth -= 1;
}

void syncthreads(const char* file, int line) {
  Block& b = *tl_block;
  ThreadState& self = *tl_current;
  if (tl_checks & kCheckSync) {
    if (b.barrier_arrived == 0) {
      b.barrier_file = file;
      b.barrier_line = line;
    } else if (line != b.barrier_line || (file != b.barrier_file && std::strcmp(file, b.barrier_file) != 0)) {
      fail_in_block(MESA_EMU_CHECK_SYNC, std::string("two different __syncthreads in one barrier generation: ") +
                                             file + ":" + std::to_string(line) + " while others wait at " +
                                             b.barrier_file + ":" + std::to_string(b.barrier_line));
    }
    check_barrier_loops(b, self, file, line);
  }
  self.barriers += 1;
  const uint64_t gen = b.barrier_generation;
  b.barrier_arrived += 1;
  b.progress += 1;
  for (;;) {
    if (b.barrier_generation != gen) break;
    if (b.barrier_arrived >= b.live) {  // everyone still running has arrived
      b.barrier_arrived = 0;
      b.barrier_generation += 1;
      break;
    }
    self.wait = 1;
    self.wait_gen = gen;
    yield_to_scheduler();
    self.wait = 0;
  }
  b.progress += 1;
}

namespace {
// The rendezvous a lane with `mask` joins (Warp::meet): with synccheck, the one in progress
// with that mask, else a free one, so that the tiles of a warp (and tile 0 and the whole warp)
// meet separately; without synccheck, meet[0], of every live lane.
unsigned meet_for(Warp& w, unsigned mask) {
  if (!(tl_checks & kCheckSync)) return 0;
  unsigned free_slot = 32;
  for (unsigned k = 0; k < 32; ++k) {
    const Meet& m = w.meet[k];
    if (m.arrived > 0) {
      if (m.mask == mask) return k;
    } else if (free_slot == 32) {
      free_slot = k;
      if (!((w.used >> k) & 1u)) break;  // the slots above are unused too: none in progress
    }
  }
  return free_slot == 32 ? 0 : free_slot;
}

// A rendezvous of the lanes of `mask` (synccheck) or of the warp's live lanes, in meet[key]
// (meet_for, taken by the caller where it must know the rendezvous before it arrives).
void warp_barrier(Warp& w, unsigned lane, unsigned mask, const char* what, bool orders_memory, unsigned key) {
  ThreadState& self = *tl_current;
  Block& b = *tl_block;
  const bool check = (tl_checks & kCheckSync) != 0;
  Meet& m = w.meet[key];
  w.used |= 1u << key;
  if (check) {
    if (!((mask >> lane) & 1u))
      fail_in_block(MESA_EMU_CHECK_SYNC, std::string(what) + " by lane " + std::to_string(lane) +
                                             ", which is not in its mask " + hex32(mask));
    if (m.arrived == 0) {
      m.mask = mask;
      m.what = what;
    } else if (m.mask != mask) {
      fail_in_block(MESA_EMU_CHECK_SYNC, std::string(what) + " with mask " + hex32(mask) + " while lanes " +
                                             lanes_text(m.arrived_mask) + " wait in " + m.what + " with mask " +
                                             hex32(m.mask));
    }
  } else if (m.arrived == 0) {
    m.mask = mask;
    m.what = what;
  }
  const uint64_t gen = m.generation;
  m.arrived += 1;
  m.arrived_mask |= 1u << lane;
  b.progress += 1;
  for (;;) {
    if (m.generation != gen) break;
    if (check && (m.mask & ~w.live_mask) != 0)
      fail_in_block(MESA_EMU_CHECK_SYNC, std::string(what) + " with mask " + hex32(m.mask) + ": lanes " +
                                             lanes_text(m.mask & ~w.live_mask) +
                                             " of the mask have exited or do not exist (arrived: lanes " +
                                             lanes_text(m.arrived_mask) + ")");
    const unsigned expected = check ? unsigned(__builtin_popcount(m.mask)) : w.live;
    if (m.arrived >= expected) {
      m.arrived = 0;
      m.arrived_mask = 0;
      m.generation += 1;
      if (orders_memory) {
        if ((m.mask & w.live_mask) == w.live_mask) {
          w.sync_generation += 1;
        } else {
          for (unsigned l = 0; l < 32; ++l)
            if ((m.mask >> l) & 1u) {
              w.lane_generation[l] += 1;
              w.lane_mask[l] = m.mask;
            }
        }
      }
      break;
    }
    self.wait = 2;
    self.wait_gen = gen;
    self.wait_key = key;
    yield_to_scheduler();
    self.wait = 0;
  }
  b.progress += 1;
}
}  // namespace

void syncwarp(unsigned mask) {
  Block& b = *tl_block;
  const unsigned tid = linear_tid(tl_current);
  Warp& w = b.warps[tid / 32];
  warp_barrier(w, tid % 32, mask, "__syncwarp", true, meet_for(w, mask));
}

// Lanes write their value into the set of the rendezvous' generation, meet, read their
// source lane's, and, with synccheck on, meet again before anyone may write that set anew.
// Without synccheck every rendezvous is of all live lanes, so a lane writes the same set again
// (two generations later) only after every live lane arrived at the generation between, that
// is after each has read: the second meeting, half of a shuffle's fiber switches, is skipped.
// With synccheck, partial masks let a lane run ahead of a lane that has not read yet.
void warp_exchange(unsigned mask, const void* value, void* out, unsigned size, unsigned src_lane) {
  Block& b = *tl_block;
  const unsigned tid = linear_tid(tl_current);
  Warp& w = b.warps[tid / 32];
  const bool check = (tl_checks & kCheckSync) != 0;
  const unsigned key = meet_for(w, mask);
  unsigned char (&slot)[32][16] = w.slot[w.meet[key].generation & 1u];
  std::memcpy(slot[tid % 32], value, size);
  warp_barrier(w, tid % 32, mask, "a shuffle", false, key);
  if (check && !((mask >> (src_lane % 32)) & 1u))
    fail_in_block(MESA_EMU_CHECK_SYNC, "a shuffle with mask " + hex32(mask) + " reads lane " +
                                           std::to_string(src_lane % 32) + ", which is not in the mask");
  std::memcpy(out, slot[src_lane % 32], size);
  if (check) warp_barrier(w, tid % 32, mask, "a shuffle", false, meet_for(w, mask));
}

unsigned warp_ballot(unsigned mask, bool pred) {
  Block& b = *tl_block;
  const unsigned tid = linear_tid(tl_current);
  Warp& w = b.warps[tid / 32];
  const bool check = (tl_checks & kCheckSync) != 0;
  const unsigned key = meet_for(w, mask);
  unsigned char (&slot)[32][16] = w.slot[w.meet[key].generation & 1u];
  slot[tid % 32][0] = pred ? 1 : 0;
  warp_barrier(w, tid % 32, mask, "a ballot/vote", false, key);
  unsigned bits = 0;
  const unsigned lanes = std::min(32u, unsigned(b.threads.size()) - (tid / 32) * 32);
  for (unsigned l = 0; l < lanes; ++l) bits |= unsigned(slot[l][0]) << l;
  bits &= check ? mask : w.live_mask;  // an exited lane votes 0
  if (check) warp_barrier(w, tid % 32, mask, "a ballot/vote", false, meet_for(w, mask));
  return bits;
}

unsigned lane_id() { return linear_tid(tl_current) % 32u; }

// A WMMA operation: a rendezvous of all 32 lanes of the warp (the GPU's `.aligned` rule: the
// whole warp executes the same wmma instruction). Each lane publishes (ptr, ldm) and `part`;
// the returned array holds every lane's, valid until this lane's next warp rendezvous. Memcheck:
// the pointer 32-byte aligned, ldm a multiple of 16 bytes (ldm_unit: the element size).
// Synccheck: every lane is in the same operation with lane 0's pointer and ldm, no lane is
// missing; then a second meeting, as in warp_exchange, before anyone may write this set anew.
const WarpMatrixSlot* warp_matrix_op(const char* what, const void* ptr, unsigned ldm, unsigned ldm_unit,
                                     const void* part, unsigned part_bytes) {
  Block& b = *tl_block;
  const unsigned tid = linear_tid(tl_current);
  Warp& w = b.warps[tid / 32];
  const bool check = (tl_checks & kCheckSync) != 0;
  if ((tl_checks & kCheckMem) && ptr != nullptr &&
      ((reinterpret_cast<uintptr_t>(ptr) % 32u) != 0 || (uint64_t(ldm) * ldm_unit) % 16u != 0))
    fail_in_block(MESA_EMU_CHECK_MEM, std::string(what) + " at " + hex64(reinterpret_cast<uintptr_t>(ptr)) +
                                          " with ldm " + std::to_string(ldm) +
                                          ": the pointer must be 32-byte aligned and ldm a multiple of 16 bytes");
  const unsigned key = meet_for(w, 0xffffffffu);
  const uint64_t gen = w.meet[key].generation;
  WarpMatrixSlot (&set)[32] = w.matrix[gen & 1u];
  set[tid % 32].generation = gen;
  set[tid % 32].op = what;
  set[tid % 32].ptr = ptr;
  set[tid % 32].ldm = ldm;
  if (part_bytes > 0) std::memcpy(set[tid % 32].part, part, part_bytes);
  warp_barrier(w, tid % 32, 0xffffffffu, what, false, key);
  if (check) {
    // Every lane compares every lane before it acts on its own pointer: the first lane to run
    // on after the rendezvous may use it at once.
    for (unsigned l = 0; l < 32; ++l)
      if (set[l].generation != gen || set[l].op == nullptr)  // it met us in a shuffle, vote or __syncwarp
        fail_in_block(MESA_EMU_CHECK_SYNC, std::string(what) + " meets lane " + std::to_string(l) +
                                               " in another warp-wide operation (a shuffle, vote or __syncwarp): "
                                               "the whole warp must execute the same warp matrix operation");
    for (unsigned l = 0; l < 32; ++l)
      if (set[l].op != what && std::strcmp(set[l].op, what) != 0)  // literals: usually one pointer
        fail_in_block(MESA_EMU_CHECK_SYNC, std::string(what) + " meets lane " + std::to_string(l) + " in " + set[l].op +
                                               ": the whole warp must execute the same warp matrix operation");
    for (unsigned l = 0; l < 32; ++l)
      if (set[l].ptr != set[0].ptr || set[l].ldm != set[0].ldm)
        fail_in_block(MESA_EMU_CHECK_SYNC, std::string(what) + ": lane " + std::to_string(l) + " passes pointer " +
                                               hex64(reinterpret_cast<uintptr_t>(set[l].ptr)) + " and ldm " +
                                               std::to_string(set[l].ldm) + ", lane 0 " +
                                               hex64(reinterpret_cast<uintptr_t>(set[0].ptr)) + " and ldm " +
                                               std::to_string(set[0].ldm) + " (a warp-wide operation takes one)");
  }
  return set;
}

// The end of a WMMA operation under synccheck (its second meeting).
void warp_matrix_done(const char* what) {
  if (!(tl_checks & kCheckSync)) return;
  Block& b = *tl_block;
  const unsigned tid = linear_tid(tl_current);
  Warp& w = b.warps[tid / 32];
  warp_barrier(w, tid % 32, 0xffffffffu, what, false, meet_for(w, 0xffffffffu));
}

unsigned char* dynamic_smem() { return tl_block->dynamic_smem.data(); }

namespace {
void check_allocations(LaunchCtx& l);
}

int launch(const char* kernel, dim3 grid, dim3 block, size_t dynamic_smem_bytes, bool cooperative,
           const std::function<void()>& body) {
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64) return cudaErrorInvalidConfiguration;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaErrorInvalidConfiguration;
  if (grid.x > kMaxGridX || grid.y > kMaxGridYZ || grid.z > kMaxGridYZ) return cudaErrorInvalidConfiguration;
  if (dynamic_smem_bytes > 227u * 1024u) return cudaErrorInvalidConfiguration;
  const unsigned long long blocks = 1ull * grid.x * grid.y * grid.z;
  if (cooperative && blocks > kMaxCooperativeBlocks) return cudaErrorCooperativeLaunchTooLarge;

  LaunchCtx ctx;
  ctx.kernel = kernel;
  ctx.checks = config_checks();
  ctx.base_seed = g_seed.load(std::memory_order_relaxed);
  {
    // the launch's seed depends on the base seed and the launch itself, not on what ran
    // before it: a failing launch replays under the same MESA_EMU_SEED in any test order
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char* c = kernel; *c != '\0'; ++c) h = (h ^ uint64_t((unsigned char)*c)) * 0x100000001b3ull;
    h ^= splitmix64(grid.x ^ (uint64_t(grid.y) << 32)) ^ splitmix64(grid.z ^ (uint64_t(block.x) << 20) ^
                                                                  (uint64_t(block.y) << 40) ^ (uint64_t(block.z) << 52));
    h ^= splitmix64(dynamic_smem_bytes);
    ctx.seed = splitmix64(ctx.base_seed ^ h);
  }
  ctx.poison = (ctx.base_seed & 1u) ? 0x7f : 0xff;  // NaN in every float type, or huge finite/NaN
  ctx.id = g_launch_ids.fetch_add(1) + 1;
  if (ctx.id == 0) ctx.id = g_launch_ids.fetch_add(1) + 1;  // 0 marks an empty shadow entry
  ctx.cooperative = cooperative;
  ctx.blocks = blocks;
  if (ctx.checks & kCheckRace) race_launch_begin(ctx);
  // blocks in the order of a seeded affine permutation i -> (a i + c) mod blocks
  unsigned long long perm_a = 1, perm_c = 0;
  if ((ctx.checks & kCheckSchedule) && blocks > 1) {
    perm_a = 1 + splitmix64(ctx.seed ^ 0xa11ce) % (blocks - 1);
    while (std::gcd(perm_a, blocks) != 1) perm_a = perm_a % (blocks - 1) + 1;
    perm_c = splitmix64(ctx.seed ^ 0xb0b) % blocks;
  }
  auto permuted = [&](unsigned long long i) {
    return (unsigned long long)(((unsigned __int128)perm_a * i + perm_c) % blocks);
  };
  auto decode = [&](unsigned long long linear) {
    return uint3{unsigned(linear % grid.x), unsigned((linear / grid.x) % grid.y),
                 unsigned(linear / (1ull * grid.x * grid.y))};
  };
  std::atomic<unsigned long long> next{0};
  std::atomic<bool> out_of_memory{false};
  auto worker = [&](bool coop_single, unsigned long long only) {
    tl_grid_dim = grid;
    tl_block_dim = block;
    LaunchCtx* outer = tl_launch;  // the caller's, when a launch runs inside a launch
    tl_launch = &ctx;
    std::unique_ptr<StackSet> stacks = take_stacks();
    if (!stacks->reserve(threads)) {
      // no fiber stacks: this worker runs nothing; the launch reports the failure
      out_of_memory = true;
      give_stacks(std::move(stacks));
      tl_launch = outer;
      return;
    }
    Block b;
    b.threads.resize(threads);
    b.warps.resize((threads + 31) / 32);
    b.dynamic_smem.assign(dynamic_smem_bytes + 16, 0);
    b.body = &body;
    if (coop_single) {
      run_block(b, *stacks, decode(only), only, true);
      ctx.blocks_done.fetch_add(1);
    } else {
      for (;;) {
        if (ctx.failed.load(std::memory_order_relaxed)) break;
        const unsigned long long i = next.fetch_add(1);
        if (i >= blocks) break;
        const unsigned long long linear = permuted(i);
        run_block(b, *stacks, decode(linear), linear, false);
      }
    }
    give_stacks(std::move(stacks));
    tl_launch = outer;
  };

  int status = cudaSuccess;
  if (cooperative) {
    // every block needs its own OS thread; if the system refuses one, the blocks already
    // started cannot meet their missing peers: their bounded waits expire, they finish, and
    // the launch reports "too large" (as cudaLaunchCooperativeKernel would up front)
    std::vector<std::thread> pool;
    pool.reserve(blocks);
    bool spawn_failed = false;
    for (unsigned long long i = 0; i < blocks && !spawn_failed; ++i) {
      try {
        pool.emplace_back(worker, true, i);
      } catch (const std::exception&) {
        spawn_failed = true;
      }
    }
    for (auto& t : pool) t.join();
    if (spawn_failed) status = cudaErrorCooperativeLaunchTooLarge;
    else status = out_of_memory ? cudaErrorMemoryAllocation : cudaSuccess;
  } else {
    const unsigned long long helpers =
        std::min<unsigned long long>(blocks, (unsigned long long)worker_count()) - 1;
    std::vector<std::thread> pool;
    pool.reserve(helpers);
    for (unsigned long long i = 0; i < helpers; ++i) {
      try {
        pool.emplace_back(worker, false, 0ull);
      } catch (const std::exception&) {
        break;  // fewer helpers: the blocks still all run, on the threads that exist
      }
    }
    worker(false, 0ull);
    for (auto& t : pool) t.join();
    // a worker without stacks ran nothing; the others may have covered its blocks, but the
    // launch is reported as failed either way
    status = out_of_memory ? cudaErrorMemoryAllocation : cudaSuccess;
  }
  if (ctx.checks & kCheckMem) check_allocations(ctx);
  if (ctx.checks & kCheckRace) race_launch_end();
  if (ctx.failed.load()) {
    if (tl_report.empty()) tl_report = symbolize(ctx.report);  // the first failure since the last take
    return kLaunchFailure;
  }
  return status;
}

// ---------------------------------------------------------------------------------------
// Emulator allocations. Under memcheck each one ends 16..31 bytes before a no-access guard
// page, the bytes between holding canaries; the registry finds an address's allocation (for
// the after-launch check and for a fault in a guard page).
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kCanaryMin = 16;

struct Guarded {
  unsigned char* map = nullptr;
  size_t map_bytes = 0;
  size_t bytes = 0;    // the caller's
  size_t canary = 0;   // canary bytes after them (alignment slack + kCanaryMin)
  std::thread::id owner;
};

std::mutex g_alloc_mutex;
std::map<uintptr_t, Guarded> g_allocs;  // by user address

unsigned char canary_byte(size_t k) { return (unsigned char)(0xa5u ^ (k * 0x3bu)); }

void arm_canary(unsigned char* end, size_t n) {
  for (size_t k = 0; k < n; ++k) end[k] = canary_byte(k);
}

void check_allocations(LaunchCtx& l) {
  const std::thread::id me = std::this_thread::get_id();
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  for (auto& [addr, g] : g_allocs) {
    if (g.owner != me) continue;
    unsigned char* end = reinterpret_cast<unsigned char*>(addr) + g.bytes;
    size_t first = g.canary, last = 0;
    for (size_t k = 0; k < g.canary; ++k) {
      if (end[k] != canary_byte(k)) {
        first = std::min(first, k);
        last = k;
      }
    }
    if (first < g.canary) {
      record_failure(l, MESA_EMU_CHECK_MEM,
                     "wrote past the end of a " + std::to_string(g.bytes) + "-byte emulator allocation: bytes +" +
                         std::to_string(first) + "..+" + std::to_string(last) + " after its end changed",
                     false);
      arm_canary(end, g.canary);
    }
  }
}

// A touch of a guard page inside a kernel: report it and leave the thread (the block is
// abandoned, as with any failed check); any other fault goes to the previous handler.
struct sigaction g_previous_segv;
std::once_flag g_segv_once;

void on_segv(int sig, siginfo_t* info, void* uctx) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(info->si_addr);
  bool ours = false;
  size_t bytes = 0;
  uintptr_t user = 0;
  if (tl_current != nullptr && tl_launch != nullptr && g_alloc_mutex.try_lock()) {
    auto it = g_allocs.upper_bound(a);
    if (it != g_allocs.begin()) {
      --it;
      const Guarded& g = it->second;
      const uintptr_t guard = reinterpret_cast<uintptr_t>(g.map) + g.map_bytes - kPage;
      if (a >= guard && a < guard + kPage) {
        ours = true;
        bytes = g.bytes;
        user = it->first;
      }
    }
    g_alloc_mutex.unlock();
  }
  if (!ours) {
    if (g_previous_segv.sa_flags & SA_SIGINFO) {
      g_previous_segv.sa_sigaction(sig, info, uctx);
    } else if (g_previous_segv.sa_handler == SIG_DFL || g_previous_segv.sa_handler == SIG_IGN) {
      signal(sig, SIG_DFL);  // returning re-executes the access: the default action
    } else {
      g_previous_segv.sa_handler(sig);
    }
    return;
  }
  record_failure(*tl_launch, MESA_EMU_CHECK_MEM,
                 "touched the guard page " + std::to_string(a - (user + bytes)) + " bytes past the end of a " +
                     std::to_string(bytes) + "-byte emulator allocation",
                 true);
  ThreadState* self = tl_current;
  tl_block->abort = true;
  self->done = true;
  self->block->live -= 1;
  // leave the faulting fiber for good (SA_NODEFER: the signal stays unblocked)
#ifdef MESA_EMU_UCONTEXT
  setcontext(&self->block->scheduler);
#else
  void* dead_sp = nullptr;
  mesa_emu_switch(&dead_sp, self->block->scheduler_sp);
#endif
}

void install_segv_handler() {
  std::call_once(g_segv_once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
  });
}

}  // namespace
}  // namespace mesa_emu


// The -fsanitize=thread callbacks of the kernel objects (racecheck above). Atomics are done
// here, sequentially consistent whatever order was asked (never weaker than the kernel's).
extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
#define MESA_RET uintptr_t(__builtin_return_address(0))
void __tsan_read_range(void* p, unsigned long n) { mesa_emu::on_access(p, n, false, MESA_RET); }
void __tsan_write_range(void* p, unsigned long n) { mesa_emu::on_access(p, n, true, MESA_RET); }
#define MESA_TSAN_RW(N)                                                                          \
  void __tsan_read##N(void* p) { mesa_emu::on_access(p, N, false, MESA_RET); }                 \
  void __tsan_write##N(void* p) { mesa_emu::on_access(p, N, true, MESA_RET); }                 \
  void __tsan_unaligned_read##N(void* p) { mesa_emu::on_access(p, N, false, MESA_RET); }       \
  void __tsan_unaligned_write##N(void* p) { mesa_emu::on_access(p, N, true, MESA_RET); }       \
  void __tsan_volatile_read##N(void* p) { mesa_emu::on_access(p, N, false, MESA_RET); }        \
  void __tsan_volatile_write##N(void* p) { mesa_emu::on_access(p, N, true, MESA_RET); }
MESA_TSAN_RW(1)
MESA_TSAN_RW(2)
MESA_TSAN_RW(4)
MESA_TSAN_RW(8)
MESA_TSAN_RW(16)
#undef MESA_TSAN_RW
// Each reports itself to racecheck (on_atomic: access, release, acquire) with the order the
// kernel asked for.
// (N: the width in bits)
#define MESA_RMW(N, a, mo) mesa_emu::on_atomic(a, (N) / 8, true, true, mo, MESA_RET)
#define MESA_TSAN_ATOMIC(N, T)                                                                   \
  T __tsan_atomic##N##_load(const volatile T* a, int mo) {                                      \
    mesa_emu::on_atomic(a, (N) / 8, true, false, mo, MESA_RET);                                  \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                 \
  }                                                                                              \
  void __tsan_atomic##N##_store(volatile T* a, T v, int mo) {                                   \
    mesa_emu::on_atomic(a, (N) / 8, false, true, mo, MESA_RET);                                  \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                    \
  }                                                                                              \
  T __tsan_atomic##N##_exchange(volatile T* a, T v, int mo) { MESA_RMW(N, a, mo); return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int mo) { MESA_RMW(N, a, mo); return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int mo) { MESA_RMW(N, a, mo); return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int mo) { MESA_RMW(N, a, mo); return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int mo) { MESA_RMW(N, a, mo); return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int mo) { MESA_RMW(N, a, mo); return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int mo) { MESA_RMW(N, a, mo); return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST); } \
  int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int mo, int) {     \
    MESA_RMW(N, a, mo);                                                                          \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);   \
  }                                                                                              \
  int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int mo, int) {       \
    MESA_RMW(N, a, mo);                                                                          \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);   \
  }                                                                                              \
  T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int mo, int) {           \
    MESA_RMW(N, a, mo);                                                                          \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);          \
    return c;                                                                                    \
  }
MESA_TSAN_ATOMIC(8, unsigned char)
MESA_TSAN_ATOMIC(16, unsigned short)
MESA_TSAN_ATOMIC(32, unsigned int)
MESA_TSAN_ATOMIC(64, unsigned long long)
#undef MESA_TSAN_ATOMIC
#undef MESA_RMW
#undef MESA_RET
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
}  // extern "C"

extern "C" {

void mesa_emu_set_checks(uint32_t checks, uint64_t seed) {
  mesa_emu::read_env();
  mesa_emu::g_checks.store(checks & MESA_EMU_CHECK_ALL);
  mesa_emu::g_seed.store(seed);
}

void mesa_emu_get_checks(uint32_t* checks, uint64_t* seed) {
  mesa_emu::read_env();
  if (checks != nullptr) *checks = mesa_emu::g_checks.load();
  if (seed != nullptr) *seed = mesa_emu::g_seed.load();
}

size_t mesa_emu_take_report(char* out, size_t cap) {
  std::string& r = mesa_emu::tl_report;
  const size_t n = r.size();
  if (out != nullptr && cap > 0) {
    const size_t k = std::min(n, cap - 1);
    std::memcpy(out, r.data(), k);
    out[k] = '\0';
  }
  r.clear();
  return n;
}

void* mesa_emu_alloc(size_t bytes, int zeroed) {
  using namespace mesa_emu;
  if (bytes == 0) bytes = 1;
  const uint32_t checks = config_checks();
  const unsigned char fill = zeroed ? 0 : ((checks & kCheckInit) ? ((g_seed.load() & 1u) ? 0x7f : 0xff) : 0);
  if (!(checks & kCheckMem)) {
    void* p = nullptr;
    if (bytes > SIZE_MAX - 64 || posix_memalign(&p, 64, bytes) != 0) return nullptr;
    std::memset(p, fill, bytes);
    race_register(p, bytes);
    return p;
  }
  install_segv_handler();
  const size_t body = ((bytes + 15) & ~size_t(15)) + kCanaryMin;
  if (body < bytes || body > SIZE_MAX - 2 * kPage) return nullptr;
  const size_t data_pages = (body + kPage - 1) / kPage;
  const size_t map_bytes = (data_pages + 1) * kPage;
  void* m = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  unsigned char* map = static_cast<unsigned char*>(m);
  if (mprotect(map + data_pages * kPage, kPage, PROT_NONE) != 0) {
    munmap(m, map_bytes);
    return nullptr;
  }
  unsigned char* user = map + data_pages * kPage - body;
  if (fill != 0) std::memset(user, fill, bytes);  // fresh anonymous pages are zero
  Guarded g;
  g.map = map;
  g.map_bytes = map_bytes;
  g.bytes = bytes;
  g.canary = body - bytes;
  g.owner = std::this_thread::get_id();
  arm_canary(user + bytes, g.canary);
  {
    std::lock_guard<std::mutex> lock(g_alloc_mutex);
    g_allocs[reinterpret_cast<uintptr_t>(user)] = g;
  }
  race_register(user, bytes);
  return user;
}

void mesa_emu_free(void* p) {
  using namespace mesa_emu;
  if (p == nullptr) return;
  race_unregister(p);
  {
    std::lock_guard<std::mutex> lock(g_alloc_mutex);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it != g_allocs.end()) {
      munmap(it->second.map, it->second.map_bytes);
      g_allocs.erase(it);
      return;
    }
  }
  std::free(p);
}

}  // extern "C"
