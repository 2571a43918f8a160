/* Barriers over a 32-bit counter in shared memory, for the tensor-parallel ranks of one
 * worker (engine/shm_comm.py). Every collective is one barrier: each rank adds one to the
 * counter after writing its slot, and reads the others' slots once the counter has reached
 * (collectives so far) x (ranks). Waiting spins a little (ranks usually arrive within
 * microseconds of each other), then sleeps in the kernel (futex) until the last arrival
 * wakes it or the time slice ends; the caller loops over slices, checking that its peers are
 * alive, so no wait is unbounded.
 */
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int reached(uint32_t value, uint32_t target) {
    return (int32_t)(value - target) >= 0; /* wrap-safe: targets advance by far less than 2^31 */
}

/* Arrive: the arrival that completes the barrier wakes every sleeper on the counter. */
void pdserve_shm_arrive(uint32_t *counter, uint32_t target) {
    uint32_t now = __atomic_add_fetch(counter, 1, __ATOMIC_ACQ_REL);
    if (now == target) {
        syscall(SYS_futex, counter, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Wait until the counter reaches target: 0 when it has, 1 when slice_us passed first. */
int pdserve_shm_wait(uint32_t *counter, uint32_t target, int64_t spins, int64_t slice_us) {
    for (int64_t i = 0; i < spins; i++) {
        if (reached(__atomic_load_n(counter, __ATOMIC_ACQUIRE), target)) return 0;
        cpu_relax();
    }
    int64_t end = now_us() + slice_us;
    for (;;) {
        uint32_t value = __atomic_load_n(counter, __ATOMIC_ACQUIRE);
        if (reached(value, target)) return 0;
        int64_t left = end - now_us();
        if (left <= 0) return 1;
        struct timespec ts = {left / 1000000, (left % 1000000) * 1000};
        /* Returns at once if the counter moved since it was read; else sleeps until woken. */
        syscall(SYS_futex, counter, FUTEX_WAIT, value, &ts, NULL, 0);
    }
}
