// hp::WeakKeyMap: a map keyed by an object's address whose entries end with what they
// belong to. The registries that attach state to modules and tensors from outside (forward
// hooks, fully_shard's managed parameters, tensor parallelism's summed gradients, the boxes
// of split parameters) all use it.
//
// Contract
// - Each entry holds a weak reference, `Weak`: anything with `bool expired() const`
//   (std::weak_ptr, c10::weak_intrusive_ptr, or a type of the caller's). An expired entry
//   is never found, so an address reused by a new object does not inherit the old one's
//   entry. (A c10::weak_intrusive_ptr to a TensorImpl also keeps the TensorImpl's memory,
//   not its data, from being reused while the entry exists.)
// - Not synchronized: the caller's mutex guards it (several maps may share one lock).
// - Values leave the map through `dropped` where the caller asks for them, so that it can
//   destroy them after releasing its lock (a value may hold state whose destructor takes
//   other locks).
#pragma once

#include <map>
#include <utility>
#include <vector>

namespace hp {

template <class Key, class Weak, class Value>
class WeakKeyMap {
 public:
  struct Entry {
    Weak owner;
    Value value;
  };

  // The live entry of `key`, or nullptr. An expired entry of `key` is erased on the way.
  Entry* find(const Key* key, std::vector<Value>* dropped = nullptr) {
    auto it = map_.find(key);
    if (it == map_.end()) return nullptr;
    if (it->second.owner.expired()) {
      drop(it, dropped);
      return nullptr;
    }
    return &it->second;
  }

  // Sets the entry of `key` to (owner, value), replacing an earlier one, live or not.
  Entry& assign(const Key* key, Weak owner, Value value, std::vector<Value>* dropped = nullptr) {
    auto it = map_.find(key);
    if (it != map_.end()) drop(it, dropped);
    return map_.emplace(key, Entry{std::move(owner), std::move(value)}).first->second;
  }

  // Erases every entry whose owner expired.
  void prune(std::vector<Value>* dropped = nullptr) {
    erase_if([](const Key*, Entry& e) { return e.owner.expired(); }, dropped);
  }

  // Erases the entries, live or not, for which pred(key, entry) is true.
  template <class Pred>
  void erase_if(Pred pred, std::vector<Value>* dropped = nullptr) {
    for (auto it = map_.begin(); it != map_.end();) {
      if (pred(it->first, it->second)) {
        auto next = std::next(it);
        drop(it, dropped);
        it = next;
      } else {
        ++it;
      }
    }
  }

  // Calls f(key, entry) for every live entry.
  template <class F>
  void for_each_live(F f) {
    for (auto& [key, e] : map_) {
      if (!e.owner.expired()) f(key, e);
    }
  }

  size_t size() const { return map_.size(); }

 private:
  using Map = std::map<const Key*, Entry>;

  void drop(typename Map::iterator it, std::vector<Value>* dropped) {
    if (dropped != nullptr) dropped->push_back(std::move(it->second.value));
    map_.erase(it);
  }

  Map map_;
};

}  // namespace hp
