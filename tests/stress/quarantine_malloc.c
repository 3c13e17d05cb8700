// A heap checker to LD_PRELOAD: it finds writes into freed heap chunks where they land, not when glibc
// next trips over a corrupted free list, and overflows past a chunk's end.
//
// Every allocation gets a 16-byte header (requested size, offset to glibc's chunk, a magic) and a 16-byte
// canary after its last byte. A freed chunk of at most QM_MAX_SIZE bytes (by default QMAX: glibc's tcache
// and fastbin sizes, where "unaligned tcache/fastbin chunk" aborts come from) is filled with FILL and held
// back in a FIFO quarantine of QM_CAP chunks and QM_BYTES bytes (chunks over QMAX in a FIFO of their own,
// QM_LARGE_BYTES), with the return address of its free (or QM_FRAMES frames of stack). A chunk is checked
// when it leaves the quarantine, by a thread that scans the whole quarantine every QM_SCAN_S seconds, and
// at exit: any changed byte (content, header or canary) is a write after free. The canary is checked at
// every free; free claims a chunk atomically, so a second free, concurrent or not, is reported.
//
// A process whose command line comes to contain QM_BIG_MATCH (Ray retitles a worker `ray::<ActorClass>`
// once it hosts an actor: QM_BIG_MATCH=TrainerWorker) grows its quarantine to QM_BIG_CAP chunks and
// QM_BIG_BYTES bytes (QM_BIG_LARGE_BYTES over QMAX), holds chunks up to QM_BIG_MAX_SIZE bytes and keeps
// QM_BIG_FRAMES frames a free: minutes of its frees instead of seconds, for writes that land long after the
// free, without that memory in every other process. (A write into a freed large buffer lands, once glibc
// reuses the memory, on whatever small chunks are carved from it.)
// A chunk of QM_GUARD_MIN bytes or more (QM_BIG_GUARD_MIN in a matching process; 0: none) is guarded instead:
// pages of its own, its end against an inaccessible page; once freed, its pages go back to the kernel and its
// range stays mapped inaccessible (the last GUARD_CAP such chunks, QM_GUARD_VA bytes of address space at
// most). The first access after the free, a read or a write from any thread, then faults where it happens
// (as does an overflow past the chunk's end): on_fault reports the chunk, its free's stack and the faulting
// one, and passes the signal on to the handlers installed before and after it (Ray's native stack,
// faulthandler's Python stacks, then the default action, a core). No memory is held for it, so it covers
// the buffers too large to quarantine.
// Each report (the process, the chunk's size and bytes, where it was freed, where it was found) goes to
// stderr and to <QM_DIR>/<pid>.log; <QM_DIR>/stats/<pid> counts what each process quarantined and checked.
// Glibc's own malloc does the allocating (glibc's `__libc_*` entry points); this file only wraps it.
//
//   gcc -O2 -fno-builtin -fPIC -shared -o quarantine_malloc.so tests/stress/quarantine_malloc.c -lpthread
//   LD_PRELOAD=$PWD/quarantine_malloc.so QM_DIR=/tmp/qm python ...   (children and Ray workers inherit it)
//
// -fno-builtin: otherwise gcc turns calloc's malloc + memset back into a call to calloc.
// One file (about 630 lines): it is built and preloaded as one shared object, with nothing to link beside it.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_memalign(size_t, size_t);

#define HDR 16
#define TRL 16
#define LIVE 0x51A7C0DEu
#define DEAD 0xDEADF4EEu
#define FREEING 0xF4EE1A6Eu  // claimed by a free still running (a second free meanwhile: a concurrent one)
#define FILL 0xA5
#define CANARY 0xC3
#define QMAX 1040           // the largest tcache chunk's user size, rounded up (QM_MAX_SIZE)
#define QCAP (1u << 18)     // chunks held back (QM_CAP)
#define QBYTES (96u << 20)  // and at most this many bytes of them (QM_BYTES)
#define NFRAMES 12
#define GLIVE 0x6A4D0A2Du     // a guarded chunk in use
#define GFREEING 0x6A4DF4EEu  // a guarded chunk being freed
#define GUARD_CAP (1u << 15)  // freed guarded chunks kept inaccessible (each a mapping: vm.max_map_count)
#define GUARD_VA (32ull << 30)  // and at most this much address space of them (QM_GUARD_VA)

struct hdr {
    uint64_t n;    // requested size
    uint32_t off;  // user pointer - glibc's pointer
    uint32_t magic;
};

struct entry {
    unsigned char *user;
    uint64_t n;
    int reported;
    void *stack[NFRAMES];
};

// A FIFO of freed chunks. Chunks over QMAX have one of their own, so that a few large buffers do not push the
// small chunks (where glibc's free-list aborts come from) out of the byte budget.
struct fifo {
    struct entry *ring;
    uint32_t head, count, cap;
    uint64_t bytes, max_bytes;
};
#define LARGE_CAP (1u << 16)

static struct fifo small = {.cap = QCAP, .max_bytes = QBYTES};
static struct fifo large = {.cap = LARGE_CAP, .max_bytes = QBYTES};
static uint32_t big_cap;
static uint64_t max_size = QMAX, big_max_size, big_bytes, big_large_bytes;
static uint64_t quarantined, evicted, scans, reports;
static unsigned scan_s = 2;
static int big_frames = -1;
static char big_match[64];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int in_backtrace;
static int ready, frames;
static char dir[200] = "/tmp/qmalloc";

// Freed guarded chunks, inaccessible: a ring, oldest unmapped first.
struct guarded {
    unsigned char *base, *user;
    uint64_t n, len;  // the chunk's size, the mapping's (with the guard page)
    void *stack[NFRAMES];
};
static struct guarded *gring;
static uint32_t ghead, gcount;
static uint64_t gbytes, guard_va = GUARD_VA, guard_min, big_guard_min, guarded_frees;
static size_t page = 4096;
static struct sigaction chained[2];  // the handlers on_fault passes SIGSEGV, SIGBUS on to

// ---------------------------------------------------------------------------------------------------------
// Reports: plain write(2)s and snprintf into stack buffers, nothing that allocates.

static void emit(const char *s, size_t len, void *const *stack, int depth) {
    char path[256];
    snprintf(path, sizeof path, "%s/%d.log", dir, (int)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    for (int target = 0; target < 2; target++) {
        int out = target ? 2 : fd;
        if (out < 0) continue;
        if (len) (void)!write(out, s, len);
        if (stack) backtrace_symbols_fd(stack, depth, out);
    }
    if (fd >= 0) close(fd);
}

static int hex(char *buf, size_t size, const char *label, const unsigned char *p, long n) {
    int len = snprintf(buf, size, "%s", label);
    for (long i = 0; i < n && len < (int)size - 4; i++) len += snprintf(buf + len, size - len, " %02x", p[i]);
    return len + snprintf(buf + len, size - len, "\n");
}

// This process's command line (as Ray retitles it), arguments joined by spaces, cut to size - 1 bytes.
static void command_line(char *cmd, size_t size) {
    memset(cmd, 0, size);
    int fd = open("/proc/self/cmdline", O_RDONLY);
    if (fd < 0) return;
    ssize_t r = read(fd, cmd, size - 1);
    close(fd);
    for (ssize_t i = 0; i < r; i++) cmd[i] = cmd[i] ? cmd[i] : ' ';
}

// The free's stack, if known, and the current one: the end of every report.
static void emit_stacks(void *const *free_stack) {
    if (free_stack) {
        int depth = 0;
        while (depth < NFRAMES && free_stack[depth]) depth++;
        emit("freed at:\n", 10, free_stack, depth);
    }
    void *now[NFRAMES];
    in_backtrace = 1;
    int depth = backtrace(now, NFRAMES);
    in_backtrace = 0;
    emit("found at:\n", 10, now, depth);
    reports++;
}

// tail: how many bytes after the chunk to show (its canary; fewer for a guarded chunk).
static void report_tail(const char *what, unsigned char *user, uint64_t n, void *const *free_stack, long tail) {
    char buf[1400], cmd[160];
    command_line(cmd, sizeof cmd);
    int len = snprintf(buf, sizeof buf,
                       "\n=== quarantine_malloc: %s: pid %d (%s) at %ld, chunk %p of %lu bytes\n", what,
                       (int)getpid(), cmd, (long)time(NULL), (void *)user, (unsigned long)n);
    len += hex(buf + len, sizeof buf - len, "header:", user - HDR, HDR);
    len += hex(buf + len, sizeof buf - len, "bytes (first 128):", user, n < 128 ? (long)n : 128);
    len += hex(buf + len, sizeof buf - len, "canary:", user + n, tail);
    emit(buf, len, NULL, 0);
    emit_stacks(free_stack);
}

static void report(const char *what, unsigned char *user, uint64_t n, void *const *free_stack) {
    report_tail(what, user, n, free_stack, TRL);
}

// ---------------------------------------------------------------------------------------------------------
// The quarantine (all under `lock`).

static int intact(const struct entry *e) {
    const struct hdr *h = (const struct hdr *)(e->user - HDR);
    if (h->magic != DEAD || h->n != e->n) return 0;
    for (uint64_t i = 0; i < e->n; i++)
        if (e->user[i] != FILL) return 0;
    for (int i = 0; i < TRL; i++)
        if (e->user[e->n + i] != CANARY) return 0;
    return 1;
}

static struct entry *nth(struct fifo *q, uint32_t i) {  // i = 0: the oldest
    return &q->ring[(q->head + q->cap - q->count + i) % q->cap];
}

static void evict_oldest(struct fifo *q) {
    struct entry *e = nth(q, 0);
    q->count--;
    q->bytes -= e->n;
    evicted++;
    if (!e->reported && !intact(e)) {
        report("write after free", e->user, e->n, e->stack);
        e->reported = 1;
    }
    if (e->reported) return;  // a changed chunk is never handed out again
    const struct hdr *h = (const struct hdr *)(e->user - HDR);
    __libc_free(e->user - h->off);
}

static void scan(const char *what) {
    char path[256], buf[200];
    pthread_mutex_lock(&lock);
    struct fifo *both[2] = {&small, &large};
    for (int k = 0; k < 2; k++)
        for (uint32_t i = 0; i < both[k]->count; i++) {
            struct entry *e = nth(both[k], i);
            if (!e->reported && !intact(e)) {
                report(what, e->user, e->n, e->stack);
                e->reported = 1;
            }
        }
    scans++;
    int len = snprintf(buf, sizeof buf,
                       "quarantined %lu evicted %lu held %u (%lu bytes) of %u, large %u (%lu bytes) "
                       "guarded %lu (from %lu bytes; %u freed held, %lu MB) scans %lu reports %lu\n",
                       (unsigned long)quarantined, (unsigned long)evicted, small.count,
                       (unsigned long)small.bytes, small.cap, large.count, (unsigned long)large.bytes,
                       (unsigned long)guarded_frees, (unsigned long)guard_min, gcount,
                       (unsigned long)(gbytes >> 20), (unsigned long)scans, (unsigned long)reports);
    pthread_mutex_unlock(&lock);
    snprintf(path, sizeof path, "%s/stats/%d", dir, (int)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        (void)!write(fd, buf, len);
        close(fd);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Guarded chunks.

static int guarding(size_t n) { return ready && guard_min && n >= guard_min && n < ((size_t)1 << 31); }

static void *guarded_alloc(size_t align, size_t n) {
    size_t a = align < 16 ? 16 : align;
    size_t data = (HDR + n + a + page - 1) & ~(page - 1);
    unsigned char *base = mmap(NULL, data + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return NULL;
    if (mprotect(base + data, page, PROT_NONE)) {
        munmap(base, data + page);
        return NULL;
    }
    // the end against the guard page, less what the alignment leaves (a canary, checked at free)
    unsigned char *user = (unsigned char *)((uintptr_t)(base + data - n) & ~(uintptr_t)(a - 1));
    struct hdr *h = (struct hdr *)(user - HDR);
    h->n = n;
    h->off = (uint32_t)(user - base);
    h->magic = GLIVE;
    memset(user + n, CANARY, base + data - (user + n));
    return user;
}

static void guarded_free(unsigned char *user, struct hdr *h, void *caller) {
    uint32_t seen = GLIVE;
    if (!__atomic_compare_exchange_n(&h->magic, &seen, GFREEING, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        report_tail("double free, concurrent: another thread is freeing the chunk now", user, h->n, NULL, 0);
        return;
    }
    uint64_t n = h->n;
    unsigned char *base = user - h->off;
    uint64_t data = (h->off + n + page - 1) & ~(uint64_t)(page - 1);
    for (unsigned char *c = user + n; c < base + data; c++)
        if (*c != CANARY) {
            report_tail("write past the chunk's end (found at its free)", user, n, NULL, base + data - (user + n));
            break;
        }
    struct guarded g = {.base = base, .user = user, .n = n, .len = data + page};
    g.stack[0] = caller;
    if (frames) {
        in_backtrace = 1;
        backtrace(g.stack, frames);
        in_backtrace = 0;
    }
    // the pages go back to the kernel; the range stays reserved and inaccessible
    if (mmap(base, g.len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
        munmap(base, g.len);
        return;
    }
    pthread_mutex_lock(&lock);
    while (gcount == GUARD_CAP || (gcount && gbytes + g.len > guard_va)) {
        struct guarded *old = &gring[(ghead + GUARD_CAP - gcount) % GUARD_CAP];
        munmap(old->base, old->len);
        gbytes -= old->len;
        gcount--;
    }
    gring[ghead] = g;
    ghead = (ghead + 1) % GUARD_CAP;
    gcount++;
    gbytes += g.len;
    guarded_frees++;
    pthread_mutex_unlock(&lock);
}

static int (*real_sigaction)(int, const struct sigaction *, struct sigaction *);
static int fault_handler_on;

// SIGSEGV / SIGBUS: which freed guarded chunk the address lies in, if any (read without the lock: the faulting
// thread may hold it); then the handlers that were there before are put back, and the signal goes to them as
// the kernel would have sent it: a fault happens again once this returns, a sent signal is sent again.
static void on_fault(int sig, siginfo_t *si, void *ctx) {
    (void)ctx;
    if (si->si_code > 0) {
        unsigned char *addr = si->si_addr;
        struct guarded *hit = NULL;
        for (uint32_t i = 0; gring && i < gcount; i++) {
            struct guarded *g = &gring[(ghead + GUARD_CAP - 1 - i) % GUARD_CAP];
            if (addr >= g->base && addr < g->base + g->len) {
                hit = g;
                break;
            }
        }
        char buf[600], cmd[160];
        command_line(cmd, sizeof cmd);
        const char *name = sig == SIGSEGV ? "SIGSEGV" : "SIGBUS";
        int len = hit ? snprintf(buf, sizeof buf,
                                 "\n=== quarantine_malloc: access to a freed chunk (%s): pid %d (%s) at %ld, "
                                 "address %p = chunk %p of %lu bytes %+ld\n",
                                 name, (int)getpid(), cmd, (long)time(NULL), (void *)addr, (void *)hit->user,
                                 (unsigned long)hit->n, (long)(addr - hit->user))
                      : snprintf(buf, sizeof buf,
                                 "\n=== quarantine_malloc: %s at address %p, in no freed guarded chunk (past a "
                                 "guarded chunk's end, or another fault): pid %d (%s) at %ld\n",
                                 name, (void *)addr, (int)getpid(), cmd, (long)time(NULL));
        emit(buf, len, NULL, 0);
        emit_stacks(hit ? hit->stack : NULL);
    }
    fault_handler_on = 0;
    real_sigaction(SIGSEGV, &chained[0], NULL);
    real_sigaction(SIGBUS, &chained[1], NULL);
    if (si->si_code <= 0) raise(sig);  // blocked here: delivered to them once this returns
}

// on_fault stays first: a SIGSEGV or SIGBUS handler installed through sigaction (Python's faulthandler, Ray's)
// becomes the one on_fault passes the fault on to, and reads back as installed. The scanner also puts it
// back in front of one installed otherwise (glibc's signal()).
static void keep_fault_handler(void) {
    if (!guard_min || !real_sigaction) return;
    struct sigaction now, mine = {.sa_sigaction = on_fault, .sa_flags = SA_SIGINFO | SA_ONSTACK};
    sigemptyset(&mine.sa_mask);
    int sigs[2] = {SIGSEGV, SIGBUS};
    for (int i = 0; i < 2; i++) {
        real_sigaction(sigs[i], NULL, &now);
        if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_fault) continue;
        chained[i] = now;
        real_sigaction(sigs[i], &mine, NULL);
    }
    fault_handler_on = 1;
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!real_sigaction) real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    if (!fault_handler_on || (sig != SIGSEGV && sig != SIGBUS)) return real_sigaction(sig, act, old);
    struct sigaction *next = &chained[sig == SIGBUS];
    if (old) *old = *next;
    if (act) *next = *act;
    return 0;
}

// Once the command line contains QM_BIG_MATCH: the QM_BIG_* settings, and the held chunks, oldest first, into
// a ring of QM_BIG_CAP where that is larger.
static void grow_if_matched(void) {
    static int grown;
    if (!big_match[0] || grown) return;
    char cmd[4096];
    command_line(cmd, sizeof cmd);
    if (!strstr(cmd, big_match)) return;
    grown = 1;
    struct entry *bigger = NULL, *old = NULL;
    uint32_t old_cap = small.cap;
    if (big_cap > small.cap) {
        bigger = mmap(NULL, sizeof(struct entry) * big_cap, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        bigger = bigger == MAP_FAILED ? NULL : bigger;
    }
    pthread_mutex_lock(&lock);
    if (bigger) {
        for (uint32_t i = 0; i < small.count; i++) bigger[i] = *nth(&small, i);
        old = small.ring;
        small.ring = bigger;
        small.head = small.count % big_cap;
        small.cap = big_cap;
    }
    small.max_bytes = big_bytes;
    large.max_bytes = big_large_bytes;
    if (big_frames >= 0) frames = big_frames;
    max_size = big_max_size;
    guard_min = big_guard_min;
    pthread_mutex_unlock(&lock);
    if (old) munmap(old, sizeof(struct entry) * old_cap);
}

static void *scanner(void *arg) {
    (void)arg;
    for (;;) {
        sleep(scan_s);
        grow_if_matched();
        keep_fault_handler();
        scan("write after free (periodic scan)");
    }
    return NULL;
}

static void start_scanner(void) {
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 256 << 10);
    pthread_create(&t, &a, scanner, NULL);
    pthread_attr_destroy(&a);
}

// fork: the child gets the lock free and a scanner of its own (threads do not survive a fork)
static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&lock); }
static void after_fork_child(void) {
    pthread_mutex_init(&lock, NULL);
    start_scanner();
}

__attribute__((constructor)) static void init(void) {
    const char *d = getenv("QM_DIR");
    if (d && *d) snprintf(dir, sizeof dir, "%s", d);
    const char *f = getenv("QM_FRAMES");
    frames = f ? atoi(f) : 0;
    frames = frames < 0 ? 0 : (frames > NFRAMES ? NFRAMES : frames);
    const char *v;
    if ((v = getenv("QM_CAP")) && atol(v) > 0) small.cap = (uint32_t)atol(v);
    if ((v = getenv("QM_BYTES")) && atol(v) > 0) small.max_bytes = (uint64_t)atol(v);
    if ((v = getenv("QM_LARGE_BYTES")) && atol(v) > 0) large.max_bytes = (uint64_t)atol(v);
    if ((v = getenv("QM_SCAN_S")) && atoi(v) > 0) scan_s = (unsigned)atoi(v);
    if ((v = getenv("QM_MAX_SIZE")) && atol(v) > 0) max_size = (uint64_t)atol(v);
    big_max_size = (v = getenv("QM_BIG_MAX_SIZE")) && atol(v) > 0 ? (uint64_t)atol(v) : max_size;
    if ((v = getenv("QM_BIG_MATCH"))) snprintf(big_match, sizeof big_match, "%s", v);
    big_cap = (v = getenv("QM_BIG_CAP")) && atol(v) > 0 ? (uint32_t)atol(v) : 16 * small.cap;
    big_bytes = (v = getenv("QM_BIG_BYTES")) && atol(v) > 0 ? (uint64_t)atol(v) : 16 * small.max_bytes;
    big_large_bytes = (v = getenv("QM_BIG_LARGE_BYTES")) && atol(v) > 0 ? (uint64_t)atol(v) : big_bytes;
    if ((v = getenv("QM_BIG_FRAMES"))) big_frames = atoi(v) < 0 ? 0 : (atoi(v) > NFRAMES ? NFRAMES : atoi(v));
    if ((v = getenv("QM_GUARD_MIN")) && atol(v) > 0) guard_min = (uint64_t)atol(v);
    big_guard_min = (v = getenv("QM_BIG_GUARD_MIN")) && atol(v) > 0 ? (uint64_t)atol(v) : guard_min;
    if ((v = getenv("QM_GUARD_VA")) && atol(v) > 0) guard_va = (uint64_t)atol(v);
    page = (size_t)sysconf(_SC_PAGESIZE);
    real_sigaction = dlsym(RTLD_NEXT, "sigaction");
    char stats[256];
    snprintf(stats, sizeof stats, "%s/stats", dir);
    mkdir(dir, 0777);
    mkdir(stats, 0777);
    small.ring = mmap(NULL, sizeof(struct entry) * small.cap, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    large.ring = mmap(NULL, sizeof(struct entry) * large.cap, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    gring = mmap(NULL, sizeof(struct guarded) * GUARD_CAP, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    // no quarantine: chunks are freed at once, canaries still checked
    if (small.ring == MAP_FAILED || large.ring == MAP_FAILED || gring == MAP_FAILED) return;
    void *warm[2];
    in_backtrace = 1;
    backtrace(warm, 2);  // loads libgcc's unwinder (which allocates) now rather than inside a free
    in_backtrace = 0;
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
    start_scanner();
    ready = 1;
    keep_fault_handler();
}

__attribute__((destructor)) static void fini(void) {
    if (ready) scan("write after free (at exit)");
}

// ---------------------------------------------------------------------------------------------------------
// The allocator's entry points.

static void *finish(unsigned char *base, size_t off, size_t n) {
    unsigned char *user = base + off;
    struct hdr *h = (struct hdr *)(user - HDR);
    h->n = n;
    h->off = (uint32_t)off;
    h->magic = LIVE;
    memset(user + n, CANARY, TRL);
    return user;
}

void *malloc(size_t n) {
    if (n > ((size_t)1 << 60)) {
        errno = ENOMEM;
        return NULL;
    }
    if (guarding(n)) {
        void *p = guarded_alloc(16, n);
        if (p) return p;
    }
    unsigned char *base = __libc_malloc(n + HDR + TRL);
    return base ? finish(base, HDR, n) : NULL;
}

static void *aligned(size_t align, size_t n) {
    if (align <= 16) return malloc(n);
    if (align & (align - 1) || n > ((size_t)1 << 60)) {
        errno = EINVAL;
        return NULL;
    }
    if (guarding(n) && align <= page) {
        void *p = guarded_alloc(align, n);
        if (p) return p;
    }
    unsigned char *base = __libc_memalign(align, n + align + TRL);
    return base ? finish(base, align, n) : NULL;
}

void free(void *p) {
    if (!p) return;
    unsigned char *user = p;
    struct hdr *h = (struct hdr *)(user - HDR);
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == GLIVE) {  // a freed one's header faults: on_fault
        guarded_free(user, h, __builtin_return_address(0));
        return;
    }
    // Claimed atomically: two threads freeing one chunk at once (a refcount race) both pass a plain check,
    // and glibc, whose tcache double-free check looks only at the freeing thread's own cache, puts the chunk
    // in both threads' caches: the next malloc hands it out while the other cache still links it.
    uint32_t seen = LIVE;
    if (!__atomic_compare_exchange_n(&h->magic, &seen, FREEING, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        if (seen == DEAD)
            report("double free (the chunk is in quarantine)", user, h->n, NULL);
        else if (seen == FREEING || seen == GFREEING)
            report_tail("double free, concurrent: another thread is freeing the chunk now", user, h->n, NULL,
                        seen == FREEING ? TRL : 0);
        else
            report("free of a pointer this allocator did not return (or its header was overwritten)", user, 0,
                   NULL);
        return;
    }
    uint64_t n = h->n;
    for (int i = 0; i < TRL; i++)
        if (user[n + i] != CANARY) {
            report("write past the chunk's end (found at its free)", user, n, NULL);
            return;
        }
    if (!ready || n > max_size || in_backtrace) {
        h->magic = 0;
        __libc_free(user - h->off);
        return;
    }
    struct entry e = {.user = user, .n = n, .reported = 0};
    e.stack[0] = __builtin_return_address(0);
    if (frames) {
        in_backtrace = 1;
        backtrace(e.stack, frames);
        in_backtrace = 0;
    }
    memset(user, FILL, n);
    __atomic_store_n(&h->magic, DEAD, __ATOMIC_RELEASE);
    pthread_mutex_lock(&lock);
    struct fifo *q = n > QMAX ? &large : &small;
    while (q->count == q->cap || (q->count && q->bytes + n > q->max_bytes)) evict_oldest(q);
    q->ring[q->head] = e;
    q->head = (q->head + 1) % q->cap;
    q->count++;
    q->bytes += n;
    quarantined++;
    pthread_mutex_unlock(&lock);
}

void *calloc(size_t a, size_t b) {
    size_t n;
    if (__builtin_mul_overflow(a, b, &n)) {
        errno = ENOMEM;
        return NULL;
    }
    void *p = malloc(n);
    if (p) memset(p, 0, n);
    return p;
}

void *realloc(void *p, size_t n) {
    if (!p) return malloc(n);
    struct hdr *h = (struct hdr *)((unsigned char *)p - HDR);
    if (h->magic != LIVE && h->magic != GLIVE) {
        report("realloc of a pointer this allocator did not return (or a freed one)", p, 0, NULL);
        errno = EINVAL;
        return NULL;
    }
    // the new chunk keeps the old one's alignment: a heap chunk's offset is its alignment; a guarded chunk
    // kept at least 64 bytes' where it was asked for (torch's) and 16 otherwise
    size_t align = h->magic == LIVE ? (h->off > HDR ? h->off : 0) : ((uintptr_t)p & 63 ? 0 : 64);
    void *q = align ? aligned(align, n) : malloc(n);
    if (!q) return NULL;
    memcpy(q, p, h->n < n ? h->n : n);
    free(p);
    return q;
}

void *reallocarray(void *p, size_t a, size_t b) {
    size_t n;
    if (__builtin_mul_overflow(a, b, &n)) {
        errno = ENOMEM;
        return NULL;
    }
    return realloc(p, n);
}

int posix_memalign(void **out, size_t align, size_t n) {
    if (align % sizeof(void *)) return EINVAL;
    void *p = aligned(align, n);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

void *memalign(size_t align, size_t n) { return aligned(align, n); }
void *aligned_alloc(size_t align, size_t n) { return aligned(align, n); }
void *valloc(size_t n) { return aligned(4096, n); }
void *pvalloc(size_t n) { return aligned(4096, (n + 4095) & ~(size_t)4095); }

size_t malloc_usable_size(void *p) {
    if (!p) return 0;
    const struct hdr *h = (const struct hdr *)((unsigned char *)p - HDR);
    return h->magic == LIVE || h->magic == GLIVE ? h->n : 0;
}
