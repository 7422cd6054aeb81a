// cooperative_groups/reduce.h — reduce and its operators live in ../cooperative_groups.h.
#pragma once
#include "../cooperative_groups.h"
