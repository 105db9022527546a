/* An error as values, the way it crosses into Python: which system or
 * libibverbs call failed, its errno, the object it was called on, and a
 * detail; `message` is the same as one sentence for logs, e.g.
 *   ibv_create_ah failed: EINVAL (22) [dev=rxe0 port=1 gid_index=1]
 * A check of this library's own (a bad option, an unknown peer) has no call
 * and no errno: only the message. Header-only: both extensions use it. */
#ifndef UDT_ERROR_H
#define UDT_ERROR_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* glibc 2.32+; declared here so that files without _GNU_SOURCE can use it */
extern const char *strerrorname_np(int errnum);

struct udt_error {
    char call[40];    /* "" when the error is a check of this library */
    int errno_value;  /* 0 when no errno applies */
    char object[160]; /* what the call was made on: "dev=rxe0 port=1", "udp 10.0.0.1:4000" */
    char detail[160]; /* what the caller can do about it, or "" */
    char message[400];
};

static inline void udt_error_clear(struct udt_error *e) { memset(e, 0, sizeof *e); }

static inline const char *udt_errno_name(int err)
{
    const char *name = strerrorname_np(err);
    return name ? name : "E?";
}

/* A failed call. detail may be NULL; object is a printf format. */
static inline __attribute__((format(printf, 5, 6))) void udt_error_call(struct udt_error *e, const char *call, int err,
                                                                         const char *detail, const char *object_format, ...)
{
    va_list args;
    va_start(args, object_format);
    vsnprintf(e->object, sizeof e->object, object_format, args);
    va_end(args);
    snprintf(e->call, sizeof e->call, "%s", call);
    e->errno_value = err;
    snprintf(e->detail, sizeof e->detail, "%s", detail ? detail : "");
    snprintf(e->message, sizeof e->message, "%s failed: %s (%d) [%s]%s%s", call, udt_errno_name(err), err, e->object,
             detail ? ": " : "", detail ? detail : "");
}

/* A check of this library failed: a sentence, no call, no errno. */
static inline __attribute__((format(printf, 2, 3))) void udt_error_check(struct udt_error *e, const char *format, ...)
{
    va_list args;
    udt_error_clear(e);
    va_start(args, format);
    vsnprintf(e->message, sizeof e->message, format, args);
    va_end(args);
}

#endif
