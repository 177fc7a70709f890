// hp::WeakKeyMap: entries end with their owner, expired ones are never found and leave
// through `dropped`, and a reused address starts empty.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "hp/core/weak_key_map.h"

namespace {
struct Obj {
  int id = 0;
};
using Map = hp::WeakKeyMap<Obj, std::weak_ptr<Obj>, std::string>;
}  // namespace

TEST(WeakKeyMap, EntriesEndWithTheirOwner) {
  Map m;
  auto a = std::make_shared<Obj>(), b = std::make_shared<Obj>();
  m.assign(a.get(), a, "a");
  m.assign(b.get(), b, "b");
  ASSERT_NE(m.find(a.get()), nullptr);
  EXPECT_EQ(m.find(a.get())->value, "a");
  const Obj* old_b = b.get();
  b.reset();
  std::vector<std::string> dropped;
  EXPECT_EQ(m.find(old_b, &dropped), nullptr) << "an expired entry is not found";
  EXPECT_EQ(dropped, std::vector<std::string>{"b"}) << "and its value is handed out";
  EXPECT_EQ(m.size(), 1u);
  // Replacing an entry hands the old value out.
  dropped.clear();
  m.assign(a.get(), a, "a2", &dropped);
  EXPECT_EQ(dropped, std::vector<std::string>{"a"});
  EXPECT_EQ(m.find(a.get())->value, "a2");
}

TEST(WeakKeyMap, PruneEraseIfAndLiveIteration) {
  Map m;
  std::vector<std::shared_ptr<Obj>> objs;
  for (int i = 0; i < 5; ++i) {
    objs.push_back(std::make_shared<Obj>(Obj{i}));
    m.assign(objs.back().get(), objs.back(), std::to_string(i));
  }
  objs[1].reset();
  objs[3].reset();
  std::vector<std::string> seen;
  m.for_each_live([&](const Obj* k, Map::Entry& e) { seen.push_back(e.value + ":" + std::to_string(k->id)); });
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<std::string>{"0:0", "2:2", "4:4"}));
  std::vector<std::string> dropped;
  m.prune(&dropped);
  std::sort(dropped.begin(), dropped.end());
  EXPECT_EQ(dropped, (std::vector<std::string>{"1", "3"}));
  EXPECT_EQ(m.size(), 3u);
  m.erase_if([](const Obj* k, Map::Entry&) { return k->id == 2; });
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m.find(objs[2].get()), nullptr);
}

TEST(WeakKeyMap, AReusedAddressDoesNotInheritTheEntry) {
  // An owner type that says whether it expired, standing for an object destroyed and a
  // new one made at the same address.
  struct Flag {
    std::shared_ptr<bool> dead;
    bool expired() const { return *dead; }
  };
  hp::WeakKeyMap<Obj, Flag, std::string> f;
  Obj slot;
  auto dead = std::make_shared<bool>(false);
  f.assign(&slot, Flag{dead}, "first");
  EXPECT_NE(f.find(&slot), nullptr);
  *dead = true;  // the first object at this address ended
  EXPECT_EQ(f.find(&slot), nullptr);
  f.assign(&slot, Flag{std::make_shared<bool>(false)}, "second");
  EXPECT_EQ(f.find(&slot)->value, "second");
}
