#pragma once
// The machine's memory and disk as the commands see them (fixtures/storage/machine_resources.hpp).
#include "fixtures/storage/machine_resources.hpp"

namespace cpgold::app {
using fx::machine_resources;
using fx::MachineResources;
}  // namespace cpgold::app
