/*
 * libopapi.so of moegrad's CANN simulator in the split layout (CANN 8.3 and later): the operator
 * lives in libopapi_transformer.so, so this library deliberately does not export it. A binding that
 * looked the operator up here instead of in libopapi_transformer.so would fail to start.
 */
#include "sim.h"

SIM_EXPORT int32_t moegradSimOpapiStub(void) { return 0; }
