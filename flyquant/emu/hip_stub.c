/* A stand-in for libamdhip64.so.7 that runs FlyDSL launches under flyquant.emu.
 *
 * FlyDSL's JIT runtime (libfly_jit_runtime.so) calls the HIP functions below, all versioned
 * hip_4.2 (see hip_stub.map). Here "device" memory is host memory (malloc/memcpy/memset),
 * streams and events are tokens (every launch completes before hipModuleLaunchKernel returns),
 * and a launch is handed to Python: flyquant.emu registers callbacks with
 * flyquant_emu_set_callbacks() before FlyDSL's runtime library is loaded.
 *
 * A Python exception inside the launch callback cannot unwind through C. The callback stores
 * it and returns non-zero; the launch then fails with hipErrorLaunchFailure and this library
 * schedules an asynchronous exception (PyThreadState_SetAsyncExc, whose address Python hands
 * over) in the launching thread, which Python raises as soon as control returns to it.
 * Nothing here links against Python: the three CPython entry points arrive as pointers.
 */
#define _GNU_SOURCE /* strdup */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int hipError_t;
enum {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorOutOfMemory = 2,
    hipErrorInvalidDevice = 101,
    hipErrorInvalidImage = 200,
    hipErrorInvalidHandle = 400,
    hipErrorNotSupported = 801,
    hipErrorLaunchFailure = 719,
};

#define GPU_ALIGNMENT 256 /* hipMalloc returns 256-byte aligned memory */

/* ---- callbacks into Python ------------------------------------------------------------ */
typedef int (*launch_cb_t)(uint64_t module_id, const void *image, size_t image_size, const char *kernel,
                           unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                           unsigned shared_bytes, void *stream, void **kernel_params);
typedef void (*alloc_cb_t)(void *ptr, size_t size); /* size 0: freed */
typedef int (*occupancy_cb_t)(uint64_t module_id, const void *image, size_t image_size, const char *kernel,
                              int block_size, size_t dynamic_shared_bytes);
typedef int (*gil_ensure_t)(void);
typedef void (*gil_release_t)(int);
typedef int (*set_async_exc_t)(unsigned long thread_id, void *exc_type);

static launch_cb_t launch_cb;
static alloc_cb_t alloc_cb;
static occupancy_cb_t occupancy_cb;
static gil_ensure_t gil_ensure;
static gil_release_t gil_release;
static set_async_exc_t set_async_exc;
static void *launch_error_type; /* a Python exception class (borrowed; Python keeps it alive) */

void flyquant_emu_set_callbacks(launch_cb_t launch, alloc_cb_t alloc, occupancy_cb_t occupancy,
                                gil_ensure_t ensure, gil_release_t release, set_async_exc_t async_exc,
                                void *error_type) {
    launch_cb = launch;
    alloc_cb = alloc;
    occupancy_cb = occupancy;
    gil_ensure = ensure;
    gil_release = release;
    set_async_exc = async_exc;
    launch_error_type = error_type;
}

/* ---- errors ------------------------------------------------------------------------------ */
static __thread hipError_t last_error = hipSuccess;

static hipError_t ret(hipError_t e) {
    if (e != hipSuccess) last_error = e;
    return e;
}

hipError_t hipGetLastError(void) {
    hipError_t e = last_error;
    last_error = hipSuccess;
    return e;
}

const char *hipGetErrorName(hipError_t e) {
    switch (e) {
    case hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
    case hipErrorInvalidImage: return "hipErrorInvalidImage";
    case hipErrorInvalidHandle: return "hipErrorInvalidHandle";
    case hipErrorNotSupported: return "hipErrorNotSupported";
    case hipErrorLaunchFailure: return "hipErrorLaunchFailure (flyquant.emu: see the Python exception)";
    default: return "hipErrorUnknown";
    }
}

/* ---- device ------------------------------------------------------------------------------ */
hipError_t hipGetDevice(int *device) {
    if (!device) return ret(hipErrorInvalidValue);
    *device = 0;
    return hipSuccess;
}

hipError_t hipSetDevice(int device) { return device == 0 ? hipSuccess : ret(hipErrorInvalidDevice); }

hipError_t hipDeviceSynchronize(void) { return hipSuccess; }

/* ---- memory: host memory ------------------------------------------------------------------- */
hipError_t hipMalloc(void **ptr, size_t size) {
    if (!ptr) return ret(hipErrorInvalidValue);
    if (size == 0) {
        *ptr = NULL;
        return hipSuccess;
    }
    size_t rounded = (size + GPU_ALIGNMENT - 1) / GPU_ALIGNMENT * GPU_ALIGNMENT;
    *ptr = aligned_alloc(GPU_ALIGNMENT, rounded);
    if (!*ptr) return ret(hipErrorOutOfMemory);
    if (alloc_cb) alloc_cb(*ptr, size);
    return hipSuccess;
}

hipError_t hipFree(void *ptr) {
    if (ptr && alloc_cb) alloc_cb(ptr, 0);
    free(ptr);
    return hipSuccess;
}

hipError_t hipMemcpy(void *dst, const void *src, size_t size, int kind) {
    (void)kind;
    if (size && (!dst || !src)) return ret(hipErrorInvalidValue);
    memmove(dst, src, size);
    return hipSuccess;
}

hipError_t hipMemcpyAsync(void *dst, const void *src, size_t size, int kind, void *stream) {
    (void)stream;
    return hipMemcpy(dst, src, size, kind);
}

hipError_t hipMemset(void *dst, int value, size_t size) {
    if (size && !dst) return ret(hipErrorInvalidValue);
    memset(dst, value, size);
    return hipSuccess;
}

hipError_t hipMemsetD16Async(void *dst, unsigned short value, size_t count, void *stream) {
    (void)stream;
    if (count && !dst) return ret(hipErrorInvalidValue);
    for (size_t i = 0; i < count; i++) memcpy((char *)dst + 2 * i, &value, 2);
    return hipSuccess;
}

hipError_t hipMemsetD32Async(void *dst, int value, size_t count, void *stream) {
    (void)stream;
    if (count && !dst) return ret(hipErrorInvalidValue);
    for (size_t i = 0; i < count; i++) memcpy((char *)dst + 4 * i, &value, 4);
    return hipSuccess;
}

/* Host memory is already device memory here: registering is a no-op, the device pointer is
 * the host pointer. */
hipError_t hipHostRegister(void *ptr, size_t size, unsigned flags) {
    (void)size;
    (void)flags;
    return ptr ? hipSuccess : ret(hipErrorInvalidValue);
}

hipError_t hipHostUnregister(void *ptr) { return ptr ? hipSuccess : ret(hipErrorInvalidValue); }

hipError_t hipHostGetDevicePointer(void **device_ptr, void *host_ptr, unsigned flags) {
    (void)flags;
    if (!device_ptr || !host_ptr) return ret(hipErrorInvalidValue);
    *device_ptr = host_ptr;
    return hipSuccess;
}

/* ---- streams and events: tokens (work completes synchronously) ----------------------------- */
hipError_t hipStreamCreate(void **stream) {
    if (!stream) return ret(hipErrorInvalidValue);
    *stream = malloc(1);
    return *stream ? hipSuccess : ret(hipErrorOutOfMemory);
}

hipError_t hipStreamDestroy(void *stream) {
    free(stream);
    return hipSuccess;
}

hipError_t hipStreamSynchronize(void *stream) {
    (void)stream;
    return hipSuccess;
}

hipError_t hipStreamWaitEvent(void *stream, void *event, unsigned flags) {
    (void)stream;
    (void)event;
    (void)flags;
    return hipSuccess;
}

hipError_t hipEventCreateWithFlags(void **event, unsigned flags) {
    (void)flags;
    if (!event) return ret(hipErrorInvalidValue);
    *event = malloc(1);
    return *event ? hipSuccess : ret(hipErrorOutOfMemory);
}

hipError_t hipEventDestroy(void *event) {
    free(event);
    return hipSuccess;
}

hipError_t hipEventRecord(void *event, void *stream) {
    (void)event;
    (void)stream;
    return hipSuccess;
}

hipError_t hipEventSynchronize(void *event) {
    (void)event;
    return hipSuccess;
}

/* ---- modules and launches ------------------------------------------------------------------ */
struct function {
    struct module *module;
    char *name;
    struct function *next;
};

struct module {
    uint64_t id; /* never reused, so Python may cache the parsed code object by it */
    void *image; /* a private copy of the code object */
    size_t size;
    struct function *functions; /* handles given out, one per kernel name */
};

static uint64_t next_module_id = 1;
static pthread_mutex_t module_lock = PTHREAD_MUTEX_INITIALIZER;

/* ELF64 header fields that bound the file: program and section header tables. The linker
 * writes the section header table last, so its end is the image size. */
static size_t elf_image_size(const unsigned char *h) {
    uint64_t phoff, shoff;
    uint16_t phentsize, phnum, shentsize, shnum;
    memcpy(&phoff, h + 32, 8);
    memcpy(&shoff, h + 40, 8);
    memcpy(&phentsize, h + 54, 2);
    memcpy(&phnum, h + 56, 2);
    memcpy(&shentsize, h + 58, 2);
    memcpy(&shnum, h + 60, 2);
    size_t ph_end = phoff + (size_t)phentsize * phnum, sh_end = shoff + (size_t)shentsize * shnum;
    return ph_end > sh_end ? ph_end : sh_end;
}

hipError_t hipModuleLoadData(void **module, const void *image) {
    static const unsigned char elf_magic[4] = {0x7f, 'E', 'L', 'F'};
    if (!module || !image) return ret(hipErrorInvalidValue);
    if (memcmp(image, elf_magic, 4) != 0 || ((const unsigned char *)image)[4] != 2 /* ELFCLASS64 */)
        return ret(hipErrorInvalidImage);
    struct module *m = malloc(sizeof *m);
    if (!m) return ret(hipErrorOutOfMemory);
    m->size = elf_image_size(image);
    m->image = malloc(m->size);
    if (!m->image) {
        free(m);
        return ret(hipErrorOutOfMemory);
    }
    memcpy(m->image, image, m->size);
    pthread_mutex_lock(&module_lock);
    m->id = next_module_id++;
    pthread_mutex_unlock(&module_lock);
    m->functions = NULL;
    *module = m;
    return hipSuccess;
}

hipError_t hipModuleUnload(void *module) {
    struct module *m = module;
    if (!m) return ret(hipErrorInvalidHandle);
    for (struct function *f = m->functions, *next; f; f = next) {
        next = f->next;
        free(f->name);
        free(f);
    }
    free(m->image);
    free(m);
    return hipSuccess;
}

/* The name is checked against the code object at launch time, by Python. FlyDSL's runtime
 * asks for the function at every launch, so handles are kept per module and name. */
hipError_t hipModuleGetFunction(void **function, void *module, const char *name) {
    struct module *m = module;
    if (!function || !m || !name) return ret(hipErrorInvalidValue);
    pthread_mutex_lock(&module_lock);
    struct function *f = m->functions;
    while (f && strcmp(f->name, name) != 0) f = f->next;
    if (!f && (f = malloc(sizeof *f))) {
        f->module = m;
        f->name = strdup(name);
        f->next = m->functions;
        if (f->name) {
            m->functions = f;
        } else {
            free(f);
            f = NULL;
        }
    }
    pthread_mutex_unlock(&module_lock);
    if (!f) return ret(hipErrorOutOfMemory);
    *function = f;
    return hipSuccess;
}

/* Raise flyquant.emu's launch error in the launching thread once it is back in Python. */
static void schedule_python_exception(void) {
    if (!gil_ensure || !set_async_exc || !launch_error_type) return;
    int state = gil_ensure();
    set_async_exc((unsigned long)pthread_self(), launch_error_type);
    gil_release(state);
}

hipError_t hipModuleLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shared_bytes, void *stream, void **kernel_params,
                                 void **extra) {
    struct function *f = function;
    if (!f) return ret(hipErrorInvalidHandle);
    if (extra) return ret(hipErrorNotSupported); /* FlyDSL passes arguments through kernel_params */
    if (!launch_cb) return ret(hipErrorNotSupported);
    int failed = launch_cb(f->module->id, f->module->image, f->module->size, f->name, gx, gy, gz, bx, by, bz,
                           shared_bytes, stream, kernel_params);
    if (failed) {
        schedule_python_exception();
        return ret(hipErrorLaunchFailure);
    }
    return hipSuccess;
}

hipError_t hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, void *function, int block_size,
                                                              size_t dynamic_shared_bytes) {
    struct function *f = function;
    if (!blocks || !f || block_size <= 0) return ret(hipErrorInvalidValue);
    if (!occupancy_cb) return ret(hipErrorNotSupported);
    int n = occupancy_cb(f->module->id, f->module->image, f->module->size, f->name, block_size,
                         dynamic_shared_bytes);
    if (n < 0) {
        schedule_python_exception();
        return ret(hipErrorInvalidValue);
    }
    *blocks = n;
    return hipSuccess;
}
