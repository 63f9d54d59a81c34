/* The driver's host time per entry point, in the calling thread (drvtime.c). */
#ifndef KVO_DRVTIME_H
#define KVO_DRVTIME_H

#include "driver.h"

/* A table whose per-transfer entry points call d's, counted and timed; the same table again for
 * the same d; NULL for another while a core is open on the timed one (one wrapped table at a
 * time). Called with the GIL held (the binding), as kvo_timed_use. */
const kvo_driver *kvo_timed_driver(const kvo_driver *d);
/* A core opened (+1) or freed (-1) on table d: while one is open on the timed table, another
 * table is not wrapped. */
void kvo_timed_use(const kvo_driver *d, int delta);
/* This thread's calls and ns per entry point (KVO_DRIVER_FIELDS each, driver.h's order) through
 * a timed table since the last reset; reset: zero them after. */
void kvo_driver_times(int64_t *calls, int64_t *ns, int reset);

#endif
