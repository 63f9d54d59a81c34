/* What every file shares (kvo.h): the clock and the message convention. */
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "kvo.h"

double kvo_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

kvo_status kvo_say(char *msg, kvo_status status, const char *fmt, ...) {
    if (msg == NULL) return status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, KVO_MSG, fmt, ap);
    va_end(ap);
    return status;
}
