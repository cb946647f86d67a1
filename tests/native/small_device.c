/* An LD_PRELOAD shim for ggml-rpc-server: sysconf(_SC_PHYS_PAGES) answers GGUFCARVE_DEVICE_BYTES
   (ggml-cpu reports a CPU device's free and total memory from it), so the server's device says it
   has that much memory; the test caps the process's address space (RLIMIT_AS) to match. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

long sysconf(int name) {
    static long (*real)(int);
    if (!real) real = (long (*)(int))dlsym(RTLD_NEXT, "sysconf");
    const char *bytes = getenv("GGUFCARVE_DEVICE_BYTES");
    if (name == _SC_PHYS_PAGES && bytes) return atol(bytes) / real(_SC_PAGE_SIZE);
    return real(name);
}
